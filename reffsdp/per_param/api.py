"""Configuration objects of the per-parameter API (mirrors ``torch.distributed.fsdp``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.comms import AllGather, Comm, ReduceScatter

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "DataParallelMeshDims",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute, gradient reduction and module outputs.

    * ``param_dtype``: dtype of the unsharded parameters used in forward/backward (the
      all-gather runs in it). The sharded parameters keep their own dtype.
    * ``reduce_dtype``: dtype of gradient reduction; defaults to the gradient dtype.
    * ``output_dtype``: cast floating-point forward outputs to this dtype.
    * ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters stay on the compute device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters (hence gradients and optimizer states) on the CPU.

    ``pin_memory`` pins them so host-to-device copies can overlap compute.
    """

    pin_memory: bool = True


@dataclass
class DataParallelMeshDims:
    """Names of the data-parallel dims of a full SPMD mesh (``shard``, ``replicate``)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs at least one of shard or replicate")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _as_names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _as_names(self.replicate)


def _as_names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


for _cls in (MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy, DataParallelMeshDims):
    _cls.__module__ = "reffsdp"
