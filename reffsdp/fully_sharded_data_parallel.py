"""Mirrors ``torch.distributed.fsdp.fully_sharded_data_parallel``: the wrapper API class and
the names its users import from this module."""

import enum

from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .wrapper import FullyShardedDataParallel


class OptimStateKeyType(enum.Enum):
    """How optimizer state dicts key their per-parameter state."""

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


OptimStateKeyType.__module__ = "reffsdp.fully_sharded_data_parallel"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]
