"""Configuration objects of the per-parameter API (mirrors ``torch.distributed.fsdp``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

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
    * ``reduce_dtype``: dtype of gradient reduction, and of gradients kept while gradient
      sync is off. Unset, it depends on the installed torch, as torch's own ``fully_shard``
      does (see entry 5 of [Note: torch versions] in ``reffsdp/core/compat.py``): up to
      2.14 the compute dtype, from 2.15 the parameter's own dtype. Gradients of different
      dtypes in one group are reduced in their promoted dtype.
    * ``output_dtype``: cast floating-point forward outputs to this dtype.
    * ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    * ``param_dtype_override_fn`` (keyword only): called once per parameter by
      ``fully_shard``; returning the parameter's own dtype keeps that parameter in it
      (e.g. norm weights in fp32), ``None`` or ``param_dtype`` uses ``param_dtype``.
      Forward inputs are still cast to ``param_dtype``. It must answer alike on every rank.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )


def param_dtype_override(policy: MixedPrecisionPolicy, param: nn.Parameter) -> torch.dtype | None:
    """The dtype ``policy.param_dtype_override_fn`` gives ``param`` in place of
    ``param_dtype``, or ``None`` to use ``param_dtype``.

    The only alternative it may choose is the parameter's own dtype; anything else is a
    ``ValueError``, as in torch.
    """
    if policy.param_dtype_override_fn is None:
        return None
    dtype = policy.param_dtype_override_fn(param)
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            "param_dtype_override_fn must return a torch.dtype or None, but it returned a "
            f"{type(dtype).__name__} ({dtype!r})"
        )
    if dtype == policy.param_dtype:
        return None
    if dtype != param.dtype:
        raise ValueError(
            f"param_dtype_override_fn returned {dtype} for a parameter of dtype {param.dtype} "
            f"(param_dtype {policy.param_dtype}); it may only return None, param_dtype or the "
            "parameter's own dtype"
        )
    return dtype


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
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims: name "
                "at least one mesh dim that data parallelism shards or replicates over"
            )

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
