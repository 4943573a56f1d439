"""The wrapper's configuration: one frozen :class:`~reffsdp.wrapper.config.WrapperConfig`,
built and checked once from the constructor's arguments and handed to auto-wrapped children
with their per-module changes as fields (see [Note: the wrapper's configuration]).

Wrappers here are built over a stand-in process group (``rank()`` and ``size()`` only), which
decides sharding and wrapping without communicating.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import wrap as torch_wrap

from reffsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from reffsdp import wrap as ref_wrap
from reffsdp.wrapper.config import WrapperConfig
from reffsdp.wrapper.state import state_of

BF16 = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)


class StandInGroup:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.b = nn.Linear(4, 4)


def _wrap(policy, model: nn.Module | None = None, **kwargs) -> FullyShardedDataParallel:
    model = model if model is not None else Net()
    return FullyShardedDataParallel(
        model, process_group=StandInGroup(), auto_wrap_policy=policy, **kwargs
    )


def test_the_config_is_frozen_and_fills_torchs_defaults():
    config = WrapperConfig(sharding_strategy=None, cpu_offload=None)
    assert config.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert config.cpu_offload == CPUOffload()
    assert config.mixed_precision is None and config.precision == MixedPrecision()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.use_orig_params = True  # type: ignore[misc]
    # Any iterable of ignored things is read once, into a tuple.
    linear = nn.Linear(2, 2)
    assert WrapperConfig(ignored_modules=iter([linear])).ignored_modules == (linear,)


def test_mixed_precision_reaches_the_group_and_the_handle_from_the_config():
    model = FullyShardedDataParallel(
        nn.Linear(4, 4), process_group=StandInGroup(), mixed_precision=BF16
    )
    state = state_of(model)
    assert state.config.mixed_precision is BF16 and model.mixed_precision is BF16
    assert state.handle.keep_low_precision_grads  # the handle's own, from the config
    assert state.group._mp_dtypes == (torch.bfloat16, torch.bfloat16)  # reduce: param_dtype
    plain = state_of(FullyShardedDataParallel(nn.Linear(4, 4), process_group=StandInGroup()))
    assert not plain.handle.keep_low_precision_grads
    assert plain.module.mixed_precision is plain.module.mixed_precision  # one object kept


@pytest.mark.filterwarnings("ignore:mixed precision and an auto_wrap_policy")
def test_children_get_the_roots_config_with_their_changes_as_fields():
    net = Net()

    def decide(module: nn.Module) -> bool | dict:
        return {"forward_prefetch": True} if module is net.b else isinstance(module, nn.Linear)

    policy = ref_wrap.CustomPolicy(decide)
    model = _wrap(policy, net, mixed_precision=BF16, use_orig_params=True)
    root = state_of(model).config
    a, norm, b = (state_of(getattr(model.module, name)).config for name in ("a", "norm", "b"))
    assert root.auto_wrap_policy is policy
    for child in (a, norm, b):
        assert child.auto_wrap_policy is None and child.use_orig_params
        assert child.process_group is root.process_group
    assert a.mixed_precision is BF16 and not a.forward_prefetch
    assert b.mixed_precision is BF16 and b.forward_prefetch  # the policy's change
    assert norm.mixed_precision is None  # batch norm runs in full precision
    assert norm.precision == MixedPrecision()


def test_a_policys_overrides_are_checked_like_the_constructors():
    for overrides, error, message in [
        ({"forward_prefetch": True}, None, None),
        ({"limit_all_gathers": "yes"}, TypeError, "limit_all_gathers must be True or False"),
        ({"prefetch": True}, TypeError, r"gave Linear the arguments \['prefetch'\]"),
    ]:
        policy = ref_wrap.CustomPolicy(
            lambda m, o=overrides: o if isinstance(m, nn.Linear) else False
        )
        if error is None:
            model = _wrap(policy)
            assert model.module.a.forward_prefetch and not model.forward_prefetch
            continue
        with pytest.raises(error, match=message):
            _wrap(policy)
    # torch's wrapper refuses an unknown name with a TypeError too (from its constructor).
    policy = torch_wrap.CustomPolicy(
        lambda m: {"prefetch": True} if isinstance(m, nn.Linear) else False
    )
    with pytest.raises(TypeError):
        TorchFSDP(
            Net(),
            process_group=StandInGroup(),
            auto_wrap_policy=policy,
            device_id=torch.device("cpu"),
        )
