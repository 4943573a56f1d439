"""The wrapper API (``FullyShardedDataParallel``): flat parameters on the shared core."""

from .flat_param import FlatParameter
from .fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["FlatParameter", "FullyShardedDataParallel"]
