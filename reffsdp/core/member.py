"""What a parameter group needs from its members: the seam between the core and the APIs.

[Note: group members]
A :class:`~reffsdp.core.param_group.ParamGroup` all-gathers, reshards and reduces a list of
members and knows nothing else about them. Two kinds of member exist:

* one parameter, sharded on its own: its shard is a DTensor, its
  unsharded form a plain tensor that views the all-gather output;
* a flat parameter: many parameters laid end to end in one padded 1-D
  buffer, sharded as a whole, with the originals as views into it.

Sizes a member reports are element counts in the member's compute dtype:

* ``shard_numel``: this rank's padded shard, the same on every rank of the shard group;
* the all-gather output it offers holds ``world_size * shard_numel`` elements, rank r's
  shard in row r (a parameter whose tensor subclass gathers itself may offer several
  inputs of its own sizes and dtypes instead, each with an output of ``world_size`` times
  its size: see [Note: all-gather extensions] in ``reffsdp/per_param/extensions.py``);
* the gradient it hands over for reduction splits, after padding its dim 0 to a multiple
  of ``world_size``, into ``world_size`` equal chunks of ``shard_numel`` elements: chunk r
  is what rank r keeps. The reduced chunk comes back through ``accept_reduced_grad``.

Two ranks, a member with a ``(3, 2)`` weight: ``shard_numel = 4`` (two rows, rank 1's
second row is padding), the all-gather output has 8 elements, and the gradient ``(3, 2)``
is padded to ``(4, 2)`` and cut into two chunks of 4 elements.

Both kinds keep their shard as one padded 1-D tensor and gather it into one 1-D buffer:
:class:`PaddedShardMember` does that alike for both, so only what differs (where the shard
and the unsharded form live, how a gradient is read and kept) is written twice.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch

from .streams import backend_for


class GroupMember(Protocol):
    """The dozen things a group asks of a member (see [Note: group members]).

    Members subclass it to inherit ``compute_dtype`` and the no-op ``before_unshard``;
    the rest each member answers itself.
    """

    @property
    def fqn(self) -> str:
        """A name for messages: the parameter's (or flat parameter's) path."""
        ...

    @property
    def requires_grad(self) -> bool:
        """Whether any gradient flows to this member (frozen members are never reduced)."""
        ...

    @property
    def is_materialized(self) -> bool:
        """False while the shard still lives on the meta device."""
        ...

    @property
    def shard_numel(self) -> int: ...

    # Mixed precision, resolved at lazy init (see [Note: mixed precision] in param_group).
    orig_dtype: torch.dtype
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the module computes with and the all-gather carries."""
        return self.param_dtype or self.orig_dtype

    def lazy_init(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        """Once, before the first all-gather: re-sync shard storage, resolve dtypes."""
        ...

    # -- all-gather ---------------------------------------------------------------------

    def before_unshard(self) -> bool:
        """Before an all-gather reads the shard, on the current stream: bring the shard up
        to date with edits made through the module (a flat parameter's originals). Returns
        whether it wrote to the shard; members with nothing to do keep this default."""
        return False

    def all_gather_inputs(self) -> list[torch.Tensor]:
        """What this rank sends, 1-D tensors on the compute device: its padded shard in the
        compute dtype (or what the parameter's all-gather extension hands over)."""
        ...

    def all_gather_outputs(self) -> list[torch.Tensor]:
        """The 1-D buffers (storage allocated) that receive the gathered rows, one per input
        of the last :meth:`all_gather_inputs`, ``world_size`` times its size and of its dtype.

        Return aliases autograd does not track (``tensor.data``): re-gathering in backward
        must not bump the version of tensors autograd saved in forward.
        """
        ...

    def finish_unshard(self) -> None:
        """After the gathered bytes landed: build or refresh the unsharded form."""
        ...

    # -- what the module sees -----------------------------------------------------------

    def to_unsharded(self) -> None:
        """Make the module compute with the unsharded form: after each all-gather, and
        once per forward (and per recompute in backward) even when the group stayed
        unsharded since the last, so a member that shows views autograd records (a flat
        parameter's) makes fresh ones for each forward's graph."""
        ...

    def to_sharded(self) -> None:
        """Make the module show the shard again and free the unsharded storage."""
        ...

    def to_sharded_post_forward(self, rank: int, world_size: int) -> None:
        """Show the shard but keep block ``rank`` of ``world_size`` of the gathered data."""
        ...

    def post_forward_all_gather_input(self) -> torch.Tensor:
        """The block kept by ``to_sharded_post_forward``, as the next all-gather's input."""
        ...

    def in_orig_dtype(self) -> AbstractContextManager[None]:
        """For the duration, gather and compute in the original dtype (``param_dtype``
        ``None``) with unsharded buffers of its own; the compute-dtype ones, which tensors
        saved for a pending backward may alias, are set aside and come back on exit
        (``ParamGroup.unsharded_in_full_precision``)."""
        ...

    # -- gradients ----------------------------------------------------------------------

    def take_grad_for_reduce(self, zeros_if_unused: bool) -> torch.Tensor | None:
        """Pop this backward's unsharded gradient (plus any kept while sync was off),
        laid out for the reduce-scatter; zeros for an unused trainable member if asked."""
        ...

    def keep_unsharded_grad(self) -> None:
        """Gradient sync is off: keep this backward's gradient (in the kept dtype) for a
        later synced backward to reduce."""
        ...

    def accept_reduced_grad(self, shard: torch.Tensor) -> bool:
        """Take this rank's reduced chunk (1-D, ``shard_numel``, already divided).

        Returns whether a non-blocking device-to-host copy is still in flight.
        """
        ...

    def discard_grads(self) -> None:
        """Drop unsharded and kept gradients (after an error mid-iteration)."""
        ...


def resolve_dtypes(
    orig_dtype: torch.dtype, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """A member's ``(param_dtype, reduce_dtype)`` with the no-op casts dropped (see
    [Note: mixed precision] in ``param_group``).

    >>> resolve_dtypes(torch.float32, torch.float32, torch.float32)
    (None, None)
    >>> resolve_dtypes(torch.float32, torch.bfloat16, torch.float32)
    (torch.bfloat16, torch.float32)
    >>> resolve_dtypes(torch.float32, torch.bfloat16, torch.bfloat16)
    (torch.bfloat16, None)
    >>> resolve_dtypes(torch.int64, torch.bfloat16, None)
    (None, None)
    """
    if param_dtype == orig_dtype or not orig_dtype.is_floating_point:
        param_dtype = None
    if reduce_dtype == (param_dtype or orig_dtype):
        reduce_dtype = None
    return param_dtype, reduce_dtype


def with_storage(
    buffer: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``buffer`` with storage for ``numel`` elements again (regrown in place, so views of
    it stay valid), or a new buffer when there is none yet or the dtype changed."""
    if buffer is None or buffer.dtype != dtype:
        return torch.empty(numel, dtype=dtype, device=device)
    storage = buffer.untyped_storage()
    nbytes = numel * buffer.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)
    return buffer


class PaddedShardMember(GroupMember):
    """The all-gather input and output of a member whose shard is one padded 1-D tensor
    (both kinds of member).

    A subclass sets ``device`` (the compute device), ``offload`` and ``gathered`` (``None``
    until the first all-gather), and answers the three methods below that raise here.
    """

    device: torch.device
    offload: bool  # the shard lives on the host (CPU offload): copied in for each all-gather
    gathered: torch.Tensor | None  # 1-D, world_size * shard_numel, compute dtype

    def _padded_shard(self) -> torch.Tensor:
        """This rank's padded shard, 1-D, in the original dtype (on the host if offloaded)."""
        raise NotImplementedError

    @property
    def _gathered_numel(self) -> int:
        """Elements of the all-gather output: ``world_size * shard_numel``."""
        raise NotImplementedError

    def _forget_unsharded(self) -> None:
        """Drop the unsharded form built on ``gathered``: a new buffer replaces it."""
        raise NotImplementedError

    # -- all-gather ---------------------------------------------------------------------

    def all_gather_inputs(self) -> list[torch.Tensor]:
        return [self.all_gather_input()]

    def all_gather_outputs(self) -> list[torch.Tensor]:
        return [self.all_gather_output()]

    def all_gather_input(self) -> torch.Tensor:
        """The padded shard on the compute device (a non-blocking copy from the host under
        CPU offload), cast to the compute dtype."""
        shard = self._padded_shard()
        if shard.device.type == "meta":
            raise RuntimeError(
                f"parameter {self.fqn} is still on the meta device at its first all-gather; "
                "materialize it first (e.g. module.to_empty(device=...) then "
                "reset_parameters())"
            )
        if self.offload or shard.device != self.device:
            shard = backend_for(self.device).to_device(shard, self.device, non_blocking=True)
        return shard.to(self.compute_dtype)

    def all_gather_output(self) -> torch.Tensor:
        """``gathered`` with storage to receive an all-gather (as an untracked alias); a new
        buffer when the compute dtype changed, and then the unsharded form is rebuilt."""
        if self.gathered is None or self.gathered.dtype != self.compute_dtype:
            self._forget_unsharded()
        self.gathered = with_storage(
            self.gathered, self._gathered_numel, self.compute_dtype, self.device
        )
        return self.gathered.data
