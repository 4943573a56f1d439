"""``reffsdp.api`` mirrors ``torch.distributed.fsdp.api`` (SPEC 1.4), member for member.

torch's module is the reference: every enum and dataclass is compared against its torch twin
(names, member order, field names, defaults, field order, frozen-ness, inheritance), so a
change on either side shows up here.
"""

from __future__ import annotations

import dataclasses
import enum

import pytest
import torch
import torch.distributed.fsdp.api as torch_api

from reffsdp import api

ENUMS = ["ShardingStrategy", "BackwardPrefetch", "StateDictType"]
DATACLASSES = [name for name in torch_api.__all__ if name not in ENUMS]


def test_all_matches_torch():
    assert api.__all__ == torch_api.__all__
    for name in api.__all__:
        assert getattr(api, name).__module__ == "reffsdp.api"


@pytest.mark.parametrize("name", ENUMS)
def test_enum_matches_torch(name):
    ours, theirs = getattr(api, name), getattr(torch_api, name)
    assert issubclass(ours, enum.Enum)
    assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]


@pytest.mark.parametrize("name", DATACLASSES)
def test_dataclass_matches_torch(name):
    ours, theirs = getattr(api, name), getattr(torch_api, name)
    assert dataclasses.is_dataclass(ours)

    def describe(cls):
        return [(f.name, f.default, f.default_factory, f.init) for f in dataclasses.fields(cls)]

    assert describe(ours) == describe(theirs)
    assert ours.__dataclass_params__.frozen == theirs.__dataclass_params__.frozen
    assert ours.__dataclass_params__.eq == theirs.__dataclass_params__.eq
    ours_bases = [base.__name__ for base in ours.__mro__]
    theirs_bases = [base.__name__ for base in theirs.__mro__]
    assert ours_bases == theirs_bases


def test_dataclasses_behave_like_torchs():
    """Same defaults on instances, same mutability, same equality."""
    assert api.MixedPrecision() == api.MixedPrecision()
    mixed = api.MixedPrecision(param_dtype=torch.bfloat16)
    assert mixed.reduce_dtype is None
    assert mixed._module_classes_to_ignore == (torch.nn.modules.batchnorm._BatchNorm,)
    mixed.keep_low_precision_grads = True  # mutable, like torch's
    assert api.LocalOptimStateDictConfig().offload_to_cpu is False
    assert api.FullOptimStateDictConfig().offload_to_cpu is True
    assert api.FullStateDictConfig(offload_to_cpu=True, rank0_only=True).rank0_only
    settings = api.StateDictSettings(
        api.StateDictType.SHARDED_STATE_DICT,
        api.ShardedStateDictConfig(_use_dtensor=True),
        api.ShardedOptimStateDictConfig(),
    )
    assert settings.state_dict_config._use_dtensor
    with pytest.raises(TypeError):
        api.StateDictSettings()  # every field is required


def test_hybrid_zero2_is_private_but_present():
    assert api.ShardingStrategy._HYBRID_SHARD_ZERO2.value == 5
    assert [m.name for m in api.ShardingStrategy][:3] == ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
