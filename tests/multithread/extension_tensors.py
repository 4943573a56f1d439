"""Parameter tensor subclasses that gather themselves, for the all-gather extension tests.

Each holds its value in fp32 (what the optimizer updates) and sends less over the wire:

* :class:`Bf16Gathered` sends its shard in bf16 (one input), padding it itself on a rank
  whose shard is short (the 5-argument pre hook knows the parameter's size);
* :class:`Bf16GatheredOldForm` is the same with the 1-argument pre hook (``mesh`` only),
  so it cannot pad: give it parameters that split evenly;
* :class:`Int8RowsGathered` sends int8 rows and one fp32 scale per row (two inputs of
  different dtypes, so the all-gather moves bytes); it does not pad either.

The post hooks rebuild a plain tensor in ``param_dtype``; the module computes with it, so
its gradient is a plain tensor too. Every hook call is logged per thread (per rank of a
threaded run) in :data:`LOG`.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

LOG = threading.local()


def log() -> list[tuple[str, dict[str, Any]]]:
    """This thread's hook calls, oldest first: ``(hook name, facts)``."""
    if not hasattr(LOG, "calls"):
        LOG.calls = []
    return LOG.calls


class Fp32Held(torch.Tensor):
    """A wrapper subclass around an fp32 tensor: every op runs on the inner tensor and
    tensor results are wrapped again, so sharding, ``copy_`` and optimizer steps keep it."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._data  # noqa: E731
        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs or {}))
        return tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["_data"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data})"


def _refill(out: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` (every rank's rows, padding last) into the unsharded parameter
    without bumping its version counter (``.data`` has a counter of its own): tensors
    autograd saved in forward stay valid."""
    if out.data.untyped_storage().data_ptr() != value.untyped_storage().data_ptr():
        out.data.copy_(value.reshape(-1)[: out.numel()].view(out.shape))


class Bf16Gathered(Fp32Held):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        log().append(("pre", {"mesh": mesh, "size": self.size(), "module": module, "self": self}))
        rows = math.ceil(outer_size[0] / mesh.size())
        padded = self._data.new_zeros((rows, *outer_size[1:]), dtype=torch.bfloat16)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        value = gathered.to(param_dtype)
        facts = {"dtypes": [gathered.dtype], "param_dtype": param_dtype, "out": out}
        log().append(("post", {**facts, "outputs": outputs, "inner": (gathered, value)}))
        if out is not None:
            _refill(out, value)
            return None
        return value, (gathered, value)


class Bf16GatheredOldForm(Bf16Gathered):
    def fsdp_pre_all_gather(self, mesh):
        log().append(("pre", {"mesh": mesh, "size": self.size(), "module": None, "self": self}))
        return (self._data.to(torch.bfloat16),), None


class Int8RowsGathered(Fp32Held):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        log().append(("pre", {"mesh": mesh, "size": self.size(), "module": module, "self": self}))
        rows = self._data.reshape(self._data.size(0), -1)
        scales = (rows.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        data = torch.round(rows / scales).to(torch.int8)
        return (data, scales), {"cols": rows.size(1)}

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        data, scales = outputs
        value = (data.to(torch.float32) * scales).to(param_dtype)
        facts = {"dtypes": [data.dtype, scales.dtype], "param_dtype": param_dtype, "out": out}
        log().append(("post", {**facts, "outputs": outputs, "inner": (value,)}))
        if out is not None:
            _refill(out, value)
            return None
        return value, (value,)


def wrap_weights(model: nn.Module, cls: type[Fp32Held]) -> nn.Module:
    """Make every ``weight`` of ``model`` a ``cls`` parameter (biases stay plain)."""
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            module.weight = nn.Parameter(cls(weight.detach().clone()), weight.requires_grad)
    return model
