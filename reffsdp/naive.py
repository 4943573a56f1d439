"""FSDP and nothing else: the idea on one page. Read this before the rest of reffsdp.

Data parallelism (DDP) keeps a whole copy of every parameter on every rank and, after each
backward, averages the gradients over the ranks. Fully sharded data parallelism computes the
very same thing while every rank keeps only a slice of each parameter. :class:`NaiveFSDP`
does three things per parameter, on ``W`` ranks:

1. **Shard** (once): flatten the parameter, pad it with zeros to a multiple of ``W``, and
   keep slice ``rank`` of ``W`` equal slices: the parameter the optimizer sees and steps.
2. **All-gather** (right before forward): every rank sends its slice and receives every
   rank's; drop the padding, restore the shape, and forward runs on the whole parameter.
3. **Reduce-scatter** (in backward, from a hook that runs once the whole parameter's
   gradient is complete): every rank sends that gradient, padded the same way; rank ``r``
   receives the sum of slice ``r`` over the ranks, which divided by ``W`` is DDP's average
   gradient for the slice it keeps.

Two ranks, a parameter of five elements ``[a b c d e]``, padded to six::

    rank 0 keeps                  [a b c]
    rank 1 keeps                  [d e 0]
    all-gather, on both ranks     [a b c d e 0]  ->  [a b c d e]
    rank 0's gradient, padded     [1 2 3 4 5 0]
    rank 1's gradient, padded     [3 4 5 6 7 0]
    reduce-scatter, rank 0        [1+3 2+4 3+5] / 2 = [2 3 4]   DDP's average for a b c
    reduce-scatter, rank 1        [4+6 5+7 0+0] / 2 = [5 6 0]   for d e (and the pad)

A tensor registered under two names (tied weights) is sharded once and gathered once per
forward, as one leaf under both names: backward sums both uses into its gradient before the
hook reduces it, once. Every backward reduces, so two backwards before an optimizer step
leave the sum of two averages in the slice's gradient, as DDP's accumulation does.

Where ``fully_shard`` and the wrapper do each step for real, in ``reffsdp/core/``:

1. ``sharding.py`` pads and chunks each parameter's dim 0 ([Note: chunk semantics]); the
   wrapper first flattens a module's parameters into one (``wrapper/flat_layout.py``).
2. ``ParamGroup.unshard`` (``param_group.py``) calls ``collectives.foreach_all_gather``: one
   all-gather for a whole group of parameters ([Note: one collective per group]).
3. ``ParamGroup.post_backward``, hooked in by ``autograd_hooks.py`` (the wrapper: by the same
   hook as here), calls ``collectives.foreach_reduce`` ([Note: gradient divide factors]).

What this page leaves out is mostly memory. Here autograd keeps the gathered parameters from
forward until backward is done with them, so at its peak a rank holds every whole parameter,
as DDP does. The real implementations free them after forward (``ParamGroup.post_forward``)
and gather them again in backward (``ParamGroup.pre_backward``): that is what saves memory.
(After forward the module holds the slices again, so activation checkpointing, which reruns
forward in backward, is not supported here.) Also left out: overlap on streams, prefetch,
mixed precision, CPU offload, HSDP, and skipping the reduction while accumulating.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reffsdp.core import comms


@dataclasses.dataclass
class NaiveParam:
    """One parameter of the wrapped module: this rank's slice and how to rebuild the whole."""

    shard: nn.Parameter  # 1D: slice ``rank`` of the flattened, padded parameter
    shape: torch.Size  # ND: the parameter's own shape
    places: list[tuple[nn.Module, str]]  # (module, attribute name): two or more when tied

    def install(self, tensor: nn.Parameter) -> None:
        """Make ``tensor`` what every module using this parameter sees."""
        for module, attr in self.places:
            setattr(module, attr, tensor)


class NaiveFSDP(nn.Module):
    """Shards every parameter of ``module`` over ``group`` (default: every rank); its
    ``parameters()`` are this rank's slices, which an optimizer built on them steps."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.sharded: dict[str, NaiveParam] = {}  # by the name module.named_parameters() uses
        by_tensor: dict[int, NaiveParam] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) not in by_tensor:
                by_tensor[id(param)] = self.sharded[name] = self._shard(param)
            owner, _, attr = name.rpartition(".")
            by_tensor[id(param)].places.append((module.get_submodule(owner), attr))
        for naive in self.sharded.values():
            naive.install(naive.shard)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for naive in self.sharded.values():
            naive.install(self._gather(naive))
        try:
            return self.module(*args, **kwargs)
        finally:  # autograd keeps the whole parameters that backward needs
            for naive in self.sharded.values():
                naive.install(naive.shard)

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` with zeros appended up to a multiple of the world size."""
        return F.pad(flat, (0, -flat.numel() % self.world_size))

    def _shard(self, param: nn.Parameter) -> NaiveParam:
        rows = self._padded(param.detach().reshape(-1)).view(self.world_size, -1)
        shard = nn.Parameter(rows[self.rank].clone(), requires_grad=param.requires_grad)
        return NaiveParam(shard, param.shape, places=[])

    def _gather(self, naive: NaiveParam) -> nn.Parameter:
        """The whole parameter, a fresh leaf whose gradient is reduced once it is complete."""
        gathered = naive.shard.new_empty(naive.shard.numel() * self.world_size)
        comms.all_gather(gathered, naive.shard.detach(), self.group)
        whole = gathered[: naive.shape.numel()].view(naive.shape)
        full = nn.Parameter(whole, requires_grad=naive.shard.requires_grad)
        if full.requires_grad:
            full.register_post_accumulate_grad_hook(lambda leaf: self._reduce(naive, leaf))
        return full

    def _reduce(self, naive: NaiveParam, full: nn.Parameter) -> None:
        """Reduce-scatter ``full``'s gradient; add this rank's average to the slice's."""
        grad = torch.empty_like(naive.shard)
        comms.reduce_scatter(grad, self._padded(full.grad.reshape(-1)), self.group)
        grad.div_(self.world_size)  # the sum over the ranks, averaged: DDP's gradient
        full.grad = None  # the whole gradient is no longer needed
        if naive.shard.grad is None:
            naive.shard.grad = grad
        else:
            naive.shard.grad += grad
