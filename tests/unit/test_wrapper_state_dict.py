"""Installing the wrapper's support in ``torch.distributed.checkpoint.state_dict``, in one
process: where that module lacks what is extended, a warning names what to use instead."""

from __future__ import annotations

import types
import warnings
from unittest import mock

import pytest

from reffsdp.core import torch_internals
from reffsdp.wrapper import dcp_support


@pytest.fixture
def not_installed(monkeypatch):
    monkeypatch.setattr(dcp_support, "_installed", False)


@pytest.mark.parametrize("present", [{}, {"FSDP": object}, {"FSDP": type("FSDP", (), {})}])
def test_a_dcp_module_without_the_names_warns_and_changes_nothing(not_installed, present):
    fake = types.SimpleNamespace(__name__="fake", **present)
    with mock.patch.object(torch_internals, "dcp_state_dict_module", return_value=fake):
        with pytest.warns(UserWarning, match="FullyShardedDataParallel.optim_state_dict"):
            dcp_support.install()
    assert vars(fake) == {"__name__": "fake", **present}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcp_support.install()  # once per process, warning included


def test_the_stand_ins_replace_the_names_once(not_installed):
    original = type("FSDP", (), {"other": staticmethod(lambda: "torch's")})
    fake = types.SimpleNamespace(
        FSDP=original, _get_module_fsdp_state_if_fully_sharded_module=lambda module: None
    )
    with mock.patch.object(torch_internals, "dcp_state_dict_module", return_value=fake):
        dcp_support.install()
        stand_in = fake.FSDP
        assert stand_in.original is original and stand_in.other() == "torch's"
        assert isinstance(original(), stand_in)
        dcp_support._installed = False
        dcp_support.install()  # a stand-in is never wrapped again
        assert fake.FSDP is stand_in
