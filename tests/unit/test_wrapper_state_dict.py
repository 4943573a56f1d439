"""The wrapper's stand-ins in ``torch.distributed.checkpoint.state_dict``, in one process:
in place only while a call needs them, never left behind, and never put there by building
a wrapper; where that module lacks what is extended, an error names what to use instead."""

from __future__ import annotations

import inspect
import types

import pytest
import torch.distributed.checkpoint.state_dict as dcp_state_dict
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

import reffsdp.checkpoint
from reffsdp import FullyShardedDataParallel
from reffsdp.core import torch_internals
from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.wrapper import dcp_support

WRAPPER_NAME, STATE_GETTER_NAME = torch_internals.DCP_WRAPPER_LOOKUPS


def _torchs_objects() -> tuple[object, object]:
    return getattr(dcp_state_dict, WRAPPER_NAME), getattr(dcp_state_dict, STATE_GETTER_NAME)


def _fake_module(monkeypatch, **names) -> types.SimpleNamespace:
    fake = types.SimpleNamespace(__name__="fake_dcp_state_dict", **names)
    monkeypatch.setattr(torch_internals, "dcp_state_dict_module", lambda: fake)
    return fake


def test_building_a_wrapper_leaves_torchs_module_alone():
    before = _torchs_objects()
    assert before[0] is TorchFSDP
    with fake_process_group(2, rank=0):
        FullyShardedDataParallel(nn.Linear(2, 2))
    assert _torchs_objects() == before


def test_the_stand_ins_are_there_only_inside():
    before = _torchs_objects()
    with reffsdp.checkpoint.recognize_wrappers():
        stand_in, get_state = _torchs_objects()
        assert stand_in is not TorchFSDP and stand_in.original is TorchFSDP
        with fake_process_group(2, rank=0):
            assert isinstance(FullyShardedDataParallel(nn.Linear(2, 2)), stand_in)
        assert issubclass(TorchFSDP, stand_in)
        assert not isinstance(nn.Linear(2, 2), stand_in)
        # everything else is torch's
        assert stand_in.full_optim_state_dict is TorchFSDP.full_optim_state_dict
        assert get_state(nn.Linear(2, 2)) is None
    assert _torchs_objects() == before


def test_torchs_objects_come_back_when_the_last_caller_leaves(monkeypatch):
    """Rank threads enter and leave in any order: the first in replaces, the last out
    restores, and an error inside still restores."""
    original = type("FSDP", (), {})
    getter = lambda module: None  # noqa: E731
    fake = _fake_module(monkeypatch, FSDP=original, **{STATE_GETTER_NAME: getter})
    first, second = dcp_support.stand_ins(), dcp_support.stand_ins()
    first.__enter__()
    stand_in = fake.FSDP
    assert stand_in.original is original
    second.__enter__()
    assert fake.FSDP is stand_in  # a stand-in is never wrapped again
    first.__exit__(None, None, None)
    assert fake.FSDP is stand_in  # the second caller is still inside
    second.__exit__(None, None, None)
    assert fake.FSDP is original and getattr(fake, STATE_GETTER_NAME) is getter
    with pytest.raises(KeyError), dcp_support.stand_ins():
        raise KeyError("inside")
    assert fake.FSDP is original


@pytest.mark.parametrize("present", [{}, {"FSDP": object}, {"FSDP": type("FSDP", (), {})}])
def test_a_dcp_module_without_the_names_raises_and_changes_nothing(monkeypatch, present):
    fake = _fake_module(monkeypatch, **present)
    before = dict(vars(fake))
    with pytest.raises(RuntimeError, match="FullyShardedDataParallel.optim_state_dict"):
        with dcp_support.stand_ins():
            pass
    assert vars(fake) == before
    assert dcp_support._entered == 0


@pytest.mark.parametrize("name", [n for n in reffsdp.checkpoint.__all__ if "state_dict" in n])
def test_the_functions_take_dcps_arguments(name):
    def parameters(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert parameters(getattr(reffsdp.checkpoint, name)) == parameters(
        getattr(dcp_state_dict, name)
    )
