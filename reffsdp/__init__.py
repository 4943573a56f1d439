"""reffsdp: a readable reference implementation of PyTorch Fully Sharded Data Parallel.

Import-compatible with ``torch.distributed.fsdp``: swap ``from torch.distributed.fsdp
import X`` for ``from reffsdp import X``.
"""

from .per_param import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
