"""``FullyShardedDataParallel.params``: each instance's flat parameter in a list, as torch's
wrapper shows it (empty for an instance that manages no parameters of its own).

Compared with torch's wrapper on the same model, in one process on a fake 4-rank group.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp.testing.fake_pg import fake_process_group


def wrapped(cls: type, use_orig_params: bool) -> nn.Module:
    """A root that owns ``2`` and wraps ``0`` and ``1`` as instances of their own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(3, 2))
    inner = {model[0], model[1]}

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or module in inner

    kwargs = dict(auto_wrap_policy=policy, use_orig_params=use_orig_params)
    if cls is TorchFSDP:
        kwargs["device_id"] = torch.device("cpu")  # torch's wrapper asks for it on CPU
    return cls(model, **kwargs)


def describe(root: nn.Module, cls: type) -> list[tuple[type, list[tuple[int, ...]], bool]]:
    """Per instance: the type of ``params``, its shapes, and whether it holds the instance's
    own flat parameter."""
    rows = []
    for instance in root.modules():
        if isinstance(instance, cls):
            params = instance.params
            own = [instance._flat_param] if instance._flat_param is not None else []
            same = len(params) == len(own) and all(p is q for p, q in zip(params, own))
            rows.append((type(params), [tuple(p.shape) for p in params], same))
    return rows


@pytest.fixture
def fake_world():
    with fake_process_group(4, rank=1):
        yield


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_params_holds_the_flat_parameter_as_torchs(fake_world, use_orig_params):
    ours = describe(wrapped(FSDP, use_orig_params), FSDP)
    theirs = describe(wrapped(TorchFSDP, use_orig_params), TorchFSDP)
    assert ours == theirs
    assert [(kind, len(shapes), same) for kind, shapes, same in ours] == [(list, 1, True)] * 3


def test_params_is_empty_without_parameters(fake_world):
    ours = FSDP(nn.ReLU())
    theirs = TorchFSDP(nn.ReLU(), device_id=torch.device("cpu"))
    assert ours.params == theirs.params == []


def test_params_follows_a_move(fake_world):
    model = wrapped(FSDP, use_orig_params=False)
    model.to(torch.float64)
    assert model.params[0] is model._flat_param
    assert model.params[0].dtype == torch.float64
