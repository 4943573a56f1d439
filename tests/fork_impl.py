"""A stand-in for someone's fork of FSDP, for ``python -m reffsdp.testing --impl tests.fork_impl``.

It exports reffsdp's per-parameter API and not the wrapper API, with one planted change:
its ``fully_shard`` divides every reduced gradient by half the data-parallel size (as a
fork that miscounts its replicas would), so gradients come out twice too large. The parity
suite must catch that on every scenario that reduces gradients, and list the wrapper
scenarios as not applicable, since the module does not export ``FullyShardedDataParallel``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
import torch.nn as nn

import reffsdp
from reffsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy

__version__ = "0.1.0+fork"


@functools.wraps(reffsdp.fully_shard)
def fully_shard(module: nn.Module | list[nn.Module], **kwargs: Any) -> Any:
    sharded = reffsdp.fully_shard(module, **kwargs)
    mesh = kwargs.get("mesh")
    size = mesh.size() if mesh is not None else dist.get_world_size()  # data-parallel ranks
    sharded.set_gradient_divide_factor(size / 2)  # the planted change: should be ``size``
    return sharded


__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "fully_shard",
]
