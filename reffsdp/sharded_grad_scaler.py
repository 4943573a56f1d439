"""``ShardedGradScaler``: loss scaling when every rank holds only a shard of the gradients.

[Note: agreeing on a skipped step]
A ``GradScaler`` multiplies the loss by a scale, unscales the gradients before the optimizer
step, and skips the step (and lowers the scale) when a gradient holds an inf or NaN. With
sharded gradients each rank checks only its own shard: an inf in rank 1's shard is invisible
to rank 0, which would step while rank 1 skips, and the ranks' parameters would drift apart.
So after unscaling, every rank all-reduces (SUM) its found-inf flags over the process group:
a non-zero flag anywhere becomes non-zero everywhere, every rank skips the same step, and
``update()`` lowers the scale the same way on every rank.

The ranks must issue the same all-reduces: there is one flag per device the gradients live
on, and a rank without gradients still contributes a zero flag on the scale's device. A flag
on CPU while the scaler runs on an accelerator (CPU-offloaded gradients) is all-reduced
through a copy on the accelerator, since accelerator backends reduce only their own tensors.

Gradients may be ``DTensor`` s (``fully_shard``): their local shards are what gets unscaled,
so the one all-reduce above is all there is (unscaling the ``DTensor`` s themselves would add
DTensor's own all-reduce of the flag per call). fp16 gradients are allowed (mixed precision
may keep gradients in low precision).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler
from torch.distributed.tensor import DTensor

from reffsdp.core import comms, torch_internals

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """A ``torch.amp.GradScaler`` whose inf checks agree across ``process_group``.

    Same arguments and use as ``GradScaler``, plus the group the gradients are sharded over
    (``None`` or ``dist.group.WORLD``: the default group). See [Note: agreeing on a skipped
    step]. Works on CPU (``device="cpu"``) as on accelerators.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = dist.group.WORLD,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            backoff_factor=backoff_factor,
            growth_factor=growth_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group
        self._flag_device = device  # where found-inf flags are all-reduced

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor, or lists, tuples or iterables of them) by the
        scale, keeping each tensor's dtype (``GradScaler`` may promote a 0-dim fp16 loss)."""
        if not self.is_enabled():
            return outputs

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                scale = torch_internals.grad_scaler_scale(self, value.device)
                scale = scale.to(device=value.device, non_blocking=True)
                return (value * scale).type(value.dtype)
            if isinstance(value, Iterable):
                scaled = map(apply, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients in place and agree on the inf check across ranks."""
        super().unscale_(optimizer)
        if self.is_enabled():
            self._all_reduce_found_inf(torch_internals.grad_scaler_found_inf(self, optimizer))

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The fused-optimizer path of ``step()`` checks without unscaling; agree on it too.
        found_inf_per_device = super()._check_inf_per_device(optimizer)
        self._all_reduce_found_inf(found_inf_per_device)
        return found_inf_per_device

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale every gradient (local shards of ``DTensor`` ones), recording infs in one
        flag per device; ``allow_fp16`` is ignored: fp16 gradients are always allowed."""
        grads = _grads_by_device_and_dtype(optimizer)
        per_device_inv_scale: dict[torch.device, torch.Tensor] = {}
        per_device_found_inf: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for device, by_dtype in grads.items():
                per_device_inv_scale[device] = inv_scale.to(device, copy=True)
                per_device_found_inf[device] = found_inf.to(device, copy=True)
                for same_dtype in by_dtype.values():
                    torch_internals.unscale_and_check_(
                        same_dtype, per_device_found_inf[device], per_device_inv_scale[device]
                    )
        if not per_device_found_inf:  # no gradients here: still take part in the all-reduce
            per_device_found_inf[found_inf.device] = found_inf.clone()
        return per_device_found_inf

    def _all_reduce_found_inf(self, found_inf_per_device: dict[Any, torch.Tensor]) -> None:
        """All-reduce (SUM) each flag over the group, in place."""
        pending = []
        for flag in found_inf_per_device.values():
            on_comm_device = flag
            if flag.device.type == "cpu" and self._flag_device != "cpu":
                on_comm_device = flag.to(self._flag_device)
            work = comms.all_reduce(on_comm_device, self.process_group, async_op=True)
            pending.append((flag, on_comm_device, work))
        for flag, on_comm_device, work in pending:
            work.wait()
            if on_comm_device is not flag:
                flag.copy_(on_comm_device)


def _grads_by_device_and_dtype(
    optimizer: torch.optim.Optimizer,
) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
    """The tensors to unscale in place: dense grads, local shards of DTensor grads, and the
    values of sparse grads."""
    grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                grad = grad.to_local()
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    # Coalesce so duplicate indices are summed before the inf check.
                    param.grad = grad = grad.coalesce()
                grad = torch_internals.sparse_values(grad)
            grouped[grad.device][grad.dtype].append(grad)
    return grouped
