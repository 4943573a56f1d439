"""Mirrors ``torch.distributed.fsdp.fully_sharded_data_parallel``: the wrapper API class and
the names its users import from this module (``FLAT_PARAM`` too, the attribute name of an
instance's flat parameter on its wrapped module, which torch's own tests import)."""

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
from .wrapper.fully_sharded_data_parallel import FLAT_PARAM as FLAT_PARAM
from .wrapper.legacy_optim_state import OptimStateKeyType

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
