"""Autograd plumbing: run code when backward reaches a module, and when it leaves it.

* Pre-backward: a hook on each forward output that requires grad fires when that output's
  gradient arrives, i.e. just before backward enters the module.
* Post-backward: forward inputs that require grad pass through an identity autograd
  function; its backward runs once the gradients w.r.t. those inputs are computed, i.e.
  when backward has left the module. Parameter gradients are accumulated before that:
  autograd runs ``AccumulateGrad`` nodes as soon as they are ready.
* The final callback runs once the whole backward pass is done.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class _PostBackward(torch.autograd.Function):
    """Identity on its tensor inputs; its backward calls ``hook`` first."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ctx.hook()
        return (None, *grads)


def register_post_backward(hook: Callable[[], None], args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Route the grad-requiring tensors of ``(args, kwargs)`` through :class:`_PostBackward`.

    Returns new ``(args, kwargs)`` to pass to the module's forward. When no input requires
    grad nothing is registered; the final callback then runs the post-backward work.
    """
    if not torch.is_grad_enabled():
        return args, kwargs
    leaves, spec = tree_flatten((args, kwargs))
    positions = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]
    if not positions:
        return args, kwargs
    outputs = _PostBackward.apply(hook, *(leaves[i] for i in positions))
    for i, out in zip(positions, outputs):
        leaves[i] = out
    return tree_unflatten(leaves, spec)


def register_pre_backward(
    hook: Callable[[torch.Tensor], None], output: Any, *, owner: str = "module"
) -> Any:
    """Call ``hook`` when the gradient of any grad-requiring tensor in ``output`` arrives.

    An in-place op on a returned *view* replaces the view's autograd node, dropping the
    hook with it: backward would then skip the unshard. We warn about view outputs.
    """
    if not torch.is_grad_enabled():
        return output
    leaves, _ = tree_flatten(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            if leaf._base is not None:
                warnings.warn(
                    f"{owner} returned a view tensor; an in-place op on it (e.g. `x += y`) "
                    "would drop FSDP's pre-backward hook and skip the all-gather. Use "
                    "out-of-place ops or `.clone()` the output first.",
                    UserWarning,
                    stacklevel=3,
                )
            leaf.register_hook(hook)
    return output


def queue_final_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1
