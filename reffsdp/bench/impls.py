"""The implementations the benchmark compares, each one way to train the same model.

reffsdp never imports torch's FSDP, not even here. torch's ``fully_shard`` and
``FullyShardedDataParallel``, the reference being measured against, are built by
``tests/benchmarks/torch_reference.py`` (:data:`REFERENCE_MODULE`), loaded on first need
in each rank: from a source checkout run at the repository root they are measured as
reffsdp's own are; elsewhere (an installed wheel) they are skipped, with the reason.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn as nn

from .models import Workload, blocks

# Display order; the ratio column divides by TORCH_FULLY_SHARD.
IMPLS = (
    "reffsdp_fully_shard",
    "torch_fully_shard",
    "reffsdp_fsdp",
    "torch_fsdp",
    "ddp",
    "local",
)
TORCH_FULLY_SHARD = "torch_fully_shard"
LABELS = {
    "reffsdp_fully_shard": "reffsdp fully_shard",
    "torch_fully_shard": "torch fully_shard",
    "reffsdp_fsdp": "reffsdp FSDP",
    "torch_fsdp": "torch FSDP",
    "ddp": "DDP",
    "local": "local (no comm)",
}
# Strategy per implementation, for the analytic bytes: "shard" (FULL_SHARD), "allreduce", None.
# Without resharding after forward the four "shard" ones become "shard_grad_op" (strategy()).
STRATEGY = {
    "reffsdp_fully_shard": "shard",
    "torch_fully_shard": "shard",
    "reffsdp_fsdp": "shard",
    "torch_fsdp": "shard",
    "ddp": "allreduce",
    "local": None,
}


# Where torch's implementations are built: a module of the tests, importable when the
# repository root is on ``sys.path`` (spawned ranks inherit the launcher's ``sys.path``).
REFERENCE_MODULE = "tests.benchmarks.torch_reference"
REFERENCE_IMPLS = ("torch_fully_shard", "torch_fsdp")
NO_REFERENCE = (
    "torch's FSDP is the reference only from a source checkout: run from the repository "
    "root (tests/benchmarks/torch_reference.py)"
)


class Skip(Exception):
    """This implementation cannot run with these options; the message says why."""


@dataclass(frozen=True)
class Options:
    """What every builder needs to know."""

    workload: Workload
    device: torch.device
    backend: str
    offload: bool
    mixed_precision: str | None  # "bf16", "fp16" or None
    # False: parameters stay unsharded from forward to backward (SHARD_GRAD_OP).
    reshard_after_forward: bool = True


def strategy(name: str, reshard_after_forward: bool) -> str | None:
    """``name``'s strategy for the analytic bytes (see :data:`STRATEGY`)."""
    if STRATEGY[name] == "shard" and not reshard_after_forward:
        return "shard_grad_op"
    return STRATEGY[name]


def _dtype(options: Options) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.mixed_precision or "")


def _reference_module() -> ModuleType | None:
    """The module that builds torch's implementations; None outside a source checkout."""
    try:
        return importlib.import_module(REFERENCE_MODULE)
    except ModuleNotFoundError as error:
        parts = REFERENCE_MODULE.split(".")
        missing = {".".join(parts[: i + 1]) for i in range(len(parts))}
        if error.name in missing:
            return None
        raise  # the module is there but something it imports is not: show that


def skip_reason(name: str, options: Options) -> str | None:
    """Why ``name`` cannot run with ``options``, decided before building anything."""
    if name == "torch_fsdp" and options.device.type == "cpu" and options.offload:
        return "torch's FullyShardedDataParallel on CPU runs only without CPU offload"
    if name == "torch_fully_shard" and options.offload and not torch.cuda.is_available():
        return "torch's fully_shard CPU offload pins host memory, which needs an accelerator"
    if name == "torch_fsdp" and options.backend == "threaded":
        return "torch's FullyShardedDataParallel is not run over the threaded process group"
    if name == "ddp" and options.backend == "threaded":
        return "DDP's C++ reducer cannot drive the Python threaded process group"
    if name in REFERENCE_IMPLS and _reference_module() is None:
        return NO_REFERENCE
    return None


def notes(name: str, options: Options) -> list[str]:
    """Options an implementation ignores (it still runs, so the reader must know)."""
    found = []
    if name in ("ddp", "local") and options.mixed_precision:
        found.append("fp32 (no mixed precision)")
    if name in ("ddp", "local") and options.offload:
        found.append("no offload")
    return found


def _fully_shard_kwargs(module, options: Options) -> dict:
    kwargs = {}
    dtype = _dtype(options)
    if dtype is not None:
        kwargs["mp_policy"] = module.MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32
        )
    if options.offload:
        kwargs["offload_policy"] = module.CPUOffloadPolicy()
    if not options.reshard_after_forward:
        kwargs["reshard_after_forward"] = False
    return kwargs


def _fully_shard(module, model: nn.Module, options: Options) -> nn.Module:
    kwargs = _fully_shard_kwargs(module, options)
    for block in blocks(model):
        module.fully_shard(block, **kwargs)
    module.fully_shard(model, **kwargs)
    return model


def _wrapper(module, wrap_module, model: nn.Module, options: Options, device_id) -> nn.Module:
    kwargs = {}
    dtype = _dtype(options)
    if dtype is not None:
        kwargs["mixed_precision"] = module.MixedPrecision(
            param_dtype=dtype, reduce_dtype=torch.float32
        )
    if options.offload:
        kwargs["cpu_offload"] = module.CPUOffload(offload_params=True)
    if not options.reshard_after_forward:
        kwargs["sharding_strategy"] = module.ShardingStrategy.SHARD_GRAD_OP
    if device_id is not None:
        kwargs["device_id"] = device_id
    policy = wrap_module.ModuleWrapPolicy({options.workload.block_class})
    return module.FullyShardedDataParallel(model, auto_wrap_policy=policy, **kwargs)


def build_reffsdp_fully_shard(model: nn.Module, options: Options) -> nn.Module:
    import reffsdp

    return _fully_shard(reffsdp, model, options)


def build_reffsdp_fsdp(model: nn.Module, options: Options) -> nn.Module:
    import reffsdp
    import reffsdp.wrap

    device_id = options.device if options.device.type == "cuda" else None
    return _wrapper(reffsdp, reffsdp.wrap, model, options, device_id)


def build_ddp(model: nn.Module, options: Options) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [options.device] if options.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def build_local(model: nn.Module, options: Options) -> nn.Module:
    return model


# reffsdp's own builders; torch's (REFERENCE_IMPLS) come from REFERENCE_MODULE's BUILDERS.
BUILDERS: dict[str, Callable[[nn.Module, Options], nn.Module]] = {
    "reffsdp_fully_shard": build_reffsdp_fully_shard,
    "reffsdp_fsdp": build_reffsdp_fsdp,
    "ddp": build_ddp,
    "local": build_local,
}


def builder(name: str) -> Callable[[nn.Module, Options], nn.Module]:
    """The function that builds ``name`` (torch's from :data:`REFERENCE_MODULE`)."""
    if name in REFERENCE_IMPLS:
        module = _reference_module()
        if module is None:
            raise Skip(NO_REFERENCE)
        return module.BUILDERS[name]
    return BUILDERS[name]


def build(name: str, base: nn.Module, options: Options) -> nn.Module:
    """A fresh copy of ``base`` trained the ``name`` way (raises :class:`Skip`)."""
    reason = skip_reason(name, options)
    if reason is not None:
        raise Skip(reason)
    return builder(name)(copy.deepcopy(base), options)
