"""Autograd plumbing: run code when backward reaches a module, and when it leaves it.

* Pre-backward: a hook on each forward output that requires grad fires when that output's
  gradient arrives, i.e. just before backward enters the module.
* Post-backward: forward inputs that require grad pass through an identity autograd
  function; its backward runs once the gradients w.r.t. those inputs are computed, i.e.
  when backward has left the module. Parameter gradients are accumulated before that:
  autograd runs ``AccumulateGrad`` nodes as soon as they are ready.
* The final callback runs once the whole backward pass is done.

Inputs and outputs are searched for tensors with :func:`tensors_in` / :func:`map_tensors`:
pytree containers (tuples, lists, dicts, named tuples, registered classes) and, as torch's
FSDP does, dataclass instances, which pytree treats as opaque leaves.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .torch_internals import in_backward as in_backward  # the front ends import these two
from .torch_internals import is_view, tree_leaves, tree_map
from .torch_internals import queue_final_callback as queue_final_callback


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _init_fields(value: Any) -> list[dataclasses.Field]:
    # Fields with init=False cannot be passed to dataclasses.replace, so they are not searched.
    return [f for f in dataclasses.fields(value) if f.init]


def tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``tree``, in the order :func:`map_tensors` visits them."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif _is_dataclass_instance(leaf):
            for f in _init_fields(leaf):
                yield from tensors_in(getattr(leaf, f.name))


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``, entering dataclass instances.

    A dataclass whose tensors all map to themselves is returned as is; otherwise a copy is
    made with ``dataclasses.replace`` (which runs its ``__init__``).
    """

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        if not _is_dataclass_instance(leaf):
            return leaf
        changes = {}
        for f in _init_fields(leaf):
            old = getattr(leaf, f.name)
            new = map_tensors(fn, old)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(leaf, **changes) if changes else leaf

    return tree_map(visit, tree)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype``, dataclass fields too:
    how both APIs cast forward inputs (and ``fully_shard`` its outputs) under mixed
    precision. Integer tensors (token ids, masks) keep their dtype."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


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
    inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    if not inputs:
        return args, kwargs
    outputs = iter(_PostBackward.apply(hook, *inputs))
    return map_tensors(lambda t: next(outputs) if t.requires_grad else t, (args, kwargs))


def register_pre_backward(
    hook: Callable[[torch.Tensor], None], output: Any, *, owner: str = "module"
) -> Any:
    """Call ``hook`` when the gradient of any grad-requiring tensor in ``output`` arrives.

    An in-place op on a returned *view* replaces the view's autograd node, dropping the
    hook with it: backward would then skip the unshard. We warn about view outputs.
    """
    if not torch.is_grad_enabled():
        return output
    for leaf in tensors_in(output):
        if leaf.requires_grad:
            if is_view(leaf):
                warnings.warn(
                    f"{owner} returned a view tensor; an in-place op on it (e.g. `x += y`) "
                    "would drop FSDP's pre-backward hook and skip the all-gather. Use "
                    "out-of-place ops or `.clone()` the output first.",
                    UserWarning,
                    stacklevel=3,
                )
            leaf.register_hook(hook)
    return output
