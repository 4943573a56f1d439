"""The built-in communication hooks of the wrapper API (``register_comm_hook``).

Mirrors ``torch.distributed.algorithms._comm_hooks.default_hooks``. A hook replaces an
instance's gradient reduction: ``hook(state, grad)`` for ``NO_SHARD`` (reduce the unsharded
flat gradient in place), ``hook(state, grad, output)`` for the sharded strategies (reduce
the padded unsharded flat gradient and leave this rank's shard in ``output``). Either way
the hook must also average: the gradients it leaves are what the optimizer sees (see
``DefaultState`` for how the default hooks divide).

The collectives go through :mod:`reffsdp.core.comms`, so the comm counters and per-rank
interception see them like any other reduction of reffsdp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import comms
from ..core.sharding import pre_post_divide_factors

__all__ = [
    "DefaultState",
    "LowPrecisionState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "reduce_scatter_hook",
]


class DefaultState:
    """What the default hooks need: the group to reduce over and the divide factors.

    The hooks average in two steps so fp16 neither underflows (all divided before the sum)
    nor overflows (all after): by ``gradient_predivide_factor`` before and
    ``gradient_postdivide_factor`` after, split as ``sharding.pre_post_divide_factors``
    splits them (eight ranks: 4 then 2; two ranks: 2 then 1).

    ``process_group`` must be given explicitly (``dist.group.WORLD`` for the default group).
    """

    __slots__ = (
        "process_group",
        "world_size",
        "gradient_predivide_factor",
        "gradient_postdivide_factor",
    )

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        if process_group is None:
            raise ValueError(
                f"{type(self).__name__} needs an explicit process_group; pass "
                "dist.group.WORLD for the default group"
            )
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        pre, post = pre_post_divide_factors(self.world_size)
        self.gradient_predivide_factor = pre
        self.gradient_postdivide_factor = post


class LowPrecisionState(DefaultState):
    """:class:`DefaultState` plus the dtype reduced gradients are cast back to."""

    __slots__ = ("parameter_type",)

    def __init__(
        self, process_group: dist.ProcessGroup, parameter_type: torch.dtype = torch.float32
    ) -> None:
        super().__init__(process_group)
        self.parameter_type = parameter_type


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """Average ``grad`` over the group in place (``NO_SHARD``)."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    comms.all_reduce(grad, state.process_group)
    if state.gradient_postdivide_factor > 1:
        grad.div_(state.gradient_postdivide_factor)


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Average ``grad`` over the group, leaving this rank's chunk in ``output``."""
    if state.gradient_predivide_factor > 1:
        grad.div_(state.gradient_predivide_factor)
    comms.reduce_scatter(output, grad, state.process_group)
    if state.gradient_postdivide_factor > 1:
        output.div_(state.gradient_postdivide_factor)


def _low_precision_hook(
    dtype: torch.dtype,
    state: LowPrecisionState,
    grad: torch.Tensor,
    output: torch.Tensor | None,
) -> None:
    """Reduce in ``dtype``, then cast the result to ``state.parameter_type``.

    The tensors keep their identity (their ``.data`` is swapped), so the caller reads the
    result from the same ``grad`` / ``output`` objects it passed in.
    """
    grad.data = grad.data.to(dtype)
    if output is None:
        allreduce_hook(state, grad)
        result = grad
    else:
        output.data = output.data.to(dtype)
        reduce_scatter_hook(state, grad, output)
        result = output
    low_precision = result.data
    result.data = low_precision.to(state.parameter_type)
    if low_precision.device.type == "cuda":
        # The cast ran on the current stream; keep the low-precision memory until it is done.
        low_precision.record_stream(torch.cuda.current_stream(low_precision.device))


def fp16_compress_hook(
    state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None
) -> None:
    """Communicate in float16 (averaging as the default hooks do), then cast back to
    ``state.parameter_type``. Works for both signatures (``output`` given or not)."""
    _low_precision_hook(torch.float16, state, grad, output)


def bf16_compress_hook(
    state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None
) -> None:
    """Like :func:`fp16_compress_hook`, communicating in bfloat16."""
    _low_precision_hook(torch.bfloat16, state, grad, output)
