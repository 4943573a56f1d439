"""The wrapper API's optimizer-state calls as torch's users call them: the same static
methods, signatures and key types as the installed torch's, and rekeying (which needs no
process group) giving torch's results. Everything that needs ranks is in
``tests/multiprocess/test_wrapper_optim_state_gloo.py``."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    OptimStateKeyType as TorchOptimStateKeyType,
)

import reffsdp
import reffsdp.fully_sharded_data_parallel
from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp import OptimStateKeyType

OPTIM_STATE_CALLS = [
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
    "rekey_optim_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
]


@pytest.mark.parametrize("name", OPTIM_STATE_CALLS)
def test_static_method_signature_matches_torch(name):
    def signature(cls):
        assert isinstance(inspect.getattr_static(cls, name), staticmethod)
        params = inspect.signature(getattr(cls, name)).parameters.values()
        return [(p.name, p.kind, p.default) for p in params]

    assert signature(FSDP) == signature(TorchFSDP)


def test_key_type_matches_torch():
    assert [(m.name, m.value) for m in OptimStateKeyType] == [
        (m.name, m.value) for m in TorchOptimStateKeyType
    ]
    assert reffsdp.fully_sharded_data_parallel.OptimStateKeyType is OptimStateKeyType
    assert OptimStateKeyType.__module__ == "reffsdp.fully_sharded_data_parallel"


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(3, 4)
        self.second = nn.Sequential(nn.Linear(4, 2))
        self.unused = nn.Parameter(torch.ones(2))  # no gradient: no state


def _trained() -> tuple[Plain, torch.optim.Optimizer, list[dict]]:
    model = Plain()
    params = list(model.parameters())
    optim_input = [{"params": params[2:][::-1]}, {"params": params[:2], "lr": 1e-3}]
    optim = torch.optim.Adam(optim_input, lr=1e-2)
    model.second(model.first(torch.randn(2, 3))).sum().backward()
    optim.step()
    return model, optim, optim_input


def _rekey(cls, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = cls.rekey_optim_state_dict(*args, **kwargs)
    return result, [
        (w.category, "`optim_input` argument is deprecated" in str(w.message)) for w in caught
    ]


@pytest.mark.parametrize("by", ["optim", "optim_input", "neither"])
def test_rekeying_both_ways_matches_torch(by):
    """Ids to names and back, with ids from the optimizer, from what it was built from
    (deprecated: a FutureWarning), or from ``model.parameters()`` (the groups then do not
    match it: ids follow the model's order)."""
    model, optim, optim_input = _trained()
    ids = optim.state_dict()
    ours_and_theirs = []
    for cls, key_type in ((FSDP, OptimStateKeyType), (TorchFSDP, TorchOptimStateKeyType)):
        kwargs = {"optim": {"optim": optim}, "optim_input": {"optim_input": optim_input}}
        kwargs = kwargs.get(by, {})
        names, warned = _rekey(cls, ids, key_type.PARAM_NAME, model, **kwargs)
        back, _ = _rekey(cls, names, key_type.PARAM_ID, model, **kwargs)
        same, _ = _rekey(cls, names, key_type.PARAM_NAME, model, **kwargs)
        assert same is names  # keyed so already: returned as it is
        ours_and_theirs.append((names, back, warned))
    (names, back, warned), (their_names, their_back, their_warned) = ours_and_theirs
    assert warned == their_warned == ([(FutureWarning, True)] if by == "optim_input" else [])
    assert names == their_names
    assert back == their_back
    if by != "neither":
        assert back == ids


def test_rekeying_rejects_mixed_keys():
    model, optim, _ = _trained()
    osd = optim.state_dict()
    osd["state"]["first.weight"] = osd["state"].pop(0)
    for cls, key_type in ((FSDP, OptimStateKeyType), (TorchFSDP, TorchOptimStateKeyType)):
        with pytest.raises(ValueError):
            cls.rekey_optim_state_dict(osd, key_type.PARAM_NAME, model, optim=optim)
