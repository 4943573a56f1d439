"""The wrapper over a stand-in process group: an object with ``rank()`` and ``size()`` only.

torch's wrapper builds over one with no process group initialized, and torch's own tests
(``test_wrap.py``, ``TestAutoWrap``) use that to check wrapping decisions without
communicating. reffsdp builds the same trees, with the same ranks, sizes and shards, and
refuses to run them (forward would communicate).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import wrap as torch_wrap

import reffsdp
from reffsdp import FullyShardedDataParallel
from reffsdp import wrap as ref_wrap

SIDES = {
    "torch": (TorchFSDP, torch_wrap, {"device_id": torch.device("cpu")}),
    "ours": (FullyShardedDataParallel, ref_wrap, {}),
}
PACKAGES = {"torch": torch_fsdp, "ours": reffsdp}


class StandInGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _nested() -> nn.Module:
    return nn.Sequential(
        nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    )


def _shape(model: nn.Module) -> list:
    """Each module's path, whether it is a wrapper, and its rank, size and shard numels."""
    found = []
    for path, module in model.named_modules():
        if hasattr(module, "world_size"):
            shards = [p.numel() for p in module.parameters(recurse=False)]
            found.append((path, module.rank, module.world_size, shards))
        elif not path.endswith("_fsdp_wrapped_module"):
            found.append((path.replace("_fsdp_wrapped_module.", ""), type(module).__name__))
    return found


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
@pytest.mark.parametrize("size", [1, 2])
def test_auto_wrapping_over_a_stand_in_builds_torchs_tree(size):
    shapes = []
    for wrapper_cls, wrap_module, extra in SIDES.values():
        group = StandInGroup(rank=size - 1, size=size)
        policy = functools.partial(wrap_module.size_based_auto_wrap_policy, min_num_params=40)
        model = wrapper_cls(_nested(), process_group=group, auto_wrap_policy=policy, **extra)
        assert model.process_group is group
        assert isinstance(model.module[2], wrapper_cls)
        shapes.append(_shape(model))
    assert shapes[0] == shapes[1]


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_wrap_with_a_stand_in_and_an_override():
    shapes = []
    for wrapper_cls, wrap_module, extra in SIDES.values():
        other = StandInGroup(rank=1, size=2)
        with wrap_module.enable_wrap(
            wrapper_cls=wrapper_cls, process_group=StandInGroup(0, 1), **extra
        ):
            layers = [
                wrap_module.wrap(nn.Linear(5, 5)),
                wrap_module.wrap(nn.Linear(5, 5), process_group=other),
            ]
        assert layers[1].process_group is other
        shapes.append([_shape(layer) for layer in layers])
    assert shapes[0] == shapes[1]


@pytest.mark.filterwarnings("ignore:Both mixed precision and an auto_wrap_policy")
@pytest.mark.filterwarnings("ignore:mixed precision and an auto_wrap_policy")
def test_custom_policy_over_a_stand_in_gives_each_wrapper_torchs_settings():
    """Per-module kwargs from a CustomPolicy, batch norm with mixed precision off: each
    wrapper's strategy, prefetch and mixed-precision settings read as torch's (no mixed
    precision reads as the default settings, as torch keeps it)."""
    settings = []
    for side, (wrapper_cls, wrap_module, extra) in SIDES.items():
        package = PACKAGES[side]
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 4)))

        def choose(module, model=model, package=package):
            if isinstance(module, nn.BatchNorm1d):
                return {"sharding_strategy": package.ShardingStrategy.NO_SHARD}
            if isinstance(module, nn.Sequential) and module is not model:
                return {"backward_prefetch": package.BackwardPrefetch.BACKWARD_POST}
            return False

        wrapped = wrapper_cls(
            model,
            process_group=StandInGroup(0, 2),
            auto_wrap_policy=wrap_module.CustomPolicy(choose),
            mixed_precision=package.MixedPrecision(param_dtype=torch.float16),
            **extra,
        )
        settings.append(
            [
                (
                    m.sharding_strategy.name,
                    m.backward_prefetch.name,
                    dataclasses.astuple(m.mixed_precision),
                )
                for m in wrapped.modules()
                if isinstance(m, wrapper_cls)
            ]
        )
    assert len(settings[0]) == 3
    assert settings[0] == settings[1]


def test_a_stand_in_cannot_run():
    model = FullyShardedDataParallel(nn.Linear(4, 4), process_group=StandInGroup(0, 2))
    with pytest.raises(TypeError, match="stand-in process group .*cannot communicate"):
        model(torch.ones(2, 4))


def test_an_object_without_rank_and_size_is_no_group():
    with pytest.raises(TypeError, match="an object with rank\\(\\) and size\\(\\)"):
        FullyShardedDataParallel(nn.Linear(4, 4), process_group=object())
