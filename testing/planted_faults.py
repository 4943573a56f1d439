"""Faults planted in the process group, below any FSDP implementation.

The self-test's bugs that patch reffsdp internals (:mod:`reffsdp.testing.self_test`) say
nothing about an implementation the suite does not own. The faults here sit one level lower,
in the process group every implementation hands its collectives to, so the same planted
fault reaches reffsdp's ``fully_shard`` and wrapper, torch's ``fully_shard`` and torch's
``FullyShardedDataParallel`` alike::

    with reduce_scatter_scaled():  # every rank's reduce-scatter result comes back x size
        run_threaded(train_next_to_ddp, 2)  # must fail its parity check

[Note: where the faults sit]
``dist.all_gather_single`` (and ``all_gather_into_tensor``, ``_all_gather_base``) ends in
the group's ``all_gather_single`` method (``_allgather_base`` before torch 2.13), and
``dist.reduce_scatter_single`` (``reduce_scatter_tensor``, ``_reduce_scatter_base``) in
``reduce_scatter_single`` (``_reduce_scatter_base``). A fault replaces those methods, for
as long as it is open, on the group classes the suite runs on: torch's ``ProcessGroup``
(gloo, NCCL; a C++ class, but Python looks its methods up like any other) and the threaded
group (:mod:`reffsdp.testing.threaded_pg`), which overrides them in Python. An all-gather
fault also takes the list form, ``dist.all_gather`` (the group's ``allgather``), but only
where it fills one buffer (:func:`gathered_buffer`): torch's ``FullyShardedDataParallel``
gathers its flat parameter that way on CPU.

What does not pass through them, so the checks stay honest: the parity checker's gathers
(``dist.all_gather`` into tensors of their own), ``all_gather_object`` (bytes), DDP's and the
verdicts' all-reduces, and on a C++ group the functional collectives of DTensor, which go
from C++ straight to the backend. On the threaded group DTensor's functional collectives do
reach these methods (c10d calls the Python group back); the self-test's scenario issues
none.

Each fault runs the real collective exactly once on every rank, so the ranks stay in step
and the collectives issued, their counts and their bytes, stay what they were: only what
the ranks receive is wrong, and the checks of losses, gradients and parameters must see it.

[Note: entering a fault]
A fault patches classes, so it is process-wide: enter it once per process, around every
rank thread of a threaded world (as the self-test does) or in each rank process of a
process backend; never from several threads at once. Whatever a fault remembers (the stale
all-gather's previous results) lives as long as that one entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from .threaded_pg import ThreadedProcessGroup, _completed_work

__all__ = [
    "ALL_GATHER",
    "DROPPED_RANK",
    "REDUCE_SCATTER",
    "GroupCall",
    "all_gather_drops_a_rank",
    "all_gather_stale",
    "gathered_buffer",
    "reduce_scatter_drops_a_rank",
    "reduce_scatter_scaled",
    "reduce_scatter_skipped",
    "tampered",
]

ALL_GATHER, REDUCE_SCATTER = "all_gather", "reduce_scatter"

# The group rank whose contribution the "drops a rank" faults lose. Rank 0 holds real
# values of every parameter, however unevenly the rows divide (the last ranks may hold
# padding only).
DROPPED_RANK = 0

# The group classes the suite's backends use (see [Note: where the faults sit]).
_GROUP_CLASSES: tuple[type, ...] = (dist.ProcessGroup, ThreadedProcessGroup)


@dataclasses.dataclass
class GroupCall:
    """One rank's all-gather or reduce-scatter as its process group receives it.

    A fault calls :meth:`run` exactly once (the other ranks wait for this one) and may then
    change :attr:`output`.
    """

    group: Any  # the calling rank's process group
    output: torch.Tensor  # all-gather: the gathered buffer; reduce-scatter: this rank's chunk
    input: torch.Tensor  # all-gather: this rank's shard; reduce-scatter: the unreduced buffer
    issue: Callable[[torch.Tensor], Any]  # the real collective, given the input to send
    work: Any = None
    ran: bool = False

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def run(self, input: torch.Tensor | None = None) -> None:
        """Run the real collective, sending ``input`` in place of this rank's own when
        given, and wait for it, so :attr:`output` holds the result."""
        assert not self.ran, "a planted fault ran the collective twice"
        self.work = self.issue(self.input if input is None else input)
        self.ran = True
        if self.work is not None:
            self.work.wait()


Tamper = Callable[[GroupCall], None]


def _tamper(call: GroupCall, tamper: Tamper) -> Any:
    """Hand ``call`` to ``tamper``; returns a work that is already done.

    Not the collective's own work: waiting on gloo's reduce-scatter work again copies the
    true result into the output again, over what the fault wrote.
    """
    with torch.no_grad():
        tamper(call)
    assert call.ran, "a planted fault skipped the collective: the other ranks wait for it"
    return None if call.work is None else _completed_work([call.output])


def _single(original: Callable[..., Any], tamper: Tamper) -> Callable[..., Any]:
    """A group method ``(output, input, options)`` that runs through ``tamper`` where it
    carries floating-point data, unchanged elsewhere: from torch 2.15 ``all_gather_object``
    gathers its pickled bytes (and their sizes) with the tensor form too."""

    def method(group: Any, output: torch.Tensor, input: torch.Tensor, *options: Any) -> Any:
        if not output.is_floating_point():
            return original(group, output, input, *options)

        def issue(sent: torch.Tensor) -> Any:
            return original(group, output, sent, *options)

        return _tamper(GroupCall(group, output, input, issue), tamper)

    return method


def _pieces(original: Callable[..., Any], tamper: Tamper) -> Callable[..., Any]:
    """The list-form all-gather ``(output_lists, inputs, options)`` through ``tamper``
    where it gathers into one buffer (:func:`gathered_buffer`), unchanged elsewhere."""

    def method(group: Any, output_lists: list, inputs: list, *options: Any) -> Any:
        buffer = gathered_buffer(output_lists, inputs)
        if buffer is None:
            return original(group, output_lists, inputs, *options)

        def issue(sent: torch.Tensor) -> Any:
            return original(group, output_lists, [sent], *options)

        return _tamper(GroupCall(group, buffer, inputs[0], issue), tamper)

    return method


def gathered_buffer(output_lists: list, inputs: list) -> torch.Tensor | None:
    """The buffer a list-form all-gather fills, as one 1-D tensor, when its outputs are the
    consecutive pieces of one floating-point buffer; ``None`` for any other all-gather.

    Such a gather is an ``all_gather_single`` in another spelling: torch's
    ``FullyShardedDataParallel`` gathers its flat parameter so on CPU, into
    ``torch.chunk(buffer, world_size)``. The parity checker gathers into tensors of their
    own, and ``all_gather_object`` into pieces of a byte buffer: neither is tampered with.
    """
    if len(output_lists) != 1 or len(inputs) != 1 or not output_lists[0]:
        return None
    pieces = output_lists[0]
    first = pieces[0]
    if not first.is_floating_point():
        return None
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for piece in pieces:
        if (
            piece.dtype != first.dtype
            or not piece.is_contiguous()
            or piece.untyped_storage().data_ptr() != storage
            or piece.storage_offset() != offset
        ):
            return None
        offset += piece.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


# The group methods a fault of each kind replaces, each with the adapter that hands its calls
# to the fault (a torch version may lack the newer name of a pair).
_METHODS: dict[str, dict[str, Callable[[Callable[..., Any], Tamper], Callable[..., Any]]]] = {
    ALL_GATHER: {"all_gather_single": _single, "_allgather_base": _single, "allgather": _pieces},
    REDUCE_SCATTER: {"reduce_scatter_single": _single, "_reduce_scatter_base": _single},
}


@contextlib.contextmanager
def tampered(kind: str, tamper: Tamper) -> Iterator[None]:
    """Route every all-gather (``kind`` :data:`ALL_GATHER`) or reduce-scatter
    (:data:`REDUCE_SCATTER`) a process group receives through ``tamper`` while open.

    ``tamper`` gets a :class:`GroupCall`, must run it once and may rewrite its output; the
    group method then returns the collective's (finished) work. Process-wide: see [Note:
    entering a fault].
    """
    with contextlib.ExitStack() as stack:
        for cls in _GROUP_CLASSES:
            for name, adapter in _METHODS[kind].items():
                if name in vars(cls):
                    method = adapter(getattr(cls, name), tamper)
                    stack.enter_context(mock.patch.object(cls, name, method))
        yield


# -- the faults -----------------------------------------------------------------------------


@contextlib.contextmanager
def reduce_scatter_scaled() -> Iterator[None]:
    """Every reduce-scatter's result comes back multiplied by the group size: a sum where a
    mean was due (a gradient divide factor lost)."""

    def tamper(call: GroupCall) -> None:
        call.run()
        call.output.mul_(call.size)

    with tampered(REDUCE_SCATTER, tamper):
        yield


@contextlib.contextmanager
def reduce_scatter_drops_a_rank() -> Iterator[None]:
    """Rank :data:`DROPPED_RANK`'s gradients never reach the reduce-scatter: it sends zeros,
    so every rank receives the reduction of the others' alone."""

    def tamper(call: GroupCall) -> None:
        call.run(torch.zeros_like(call.input) if call.rank == DROPPED_RANK else None)

    with tampered(REDUCE_SCATTER, tamper):
        yield


@contextlib.contextmanager
def reduce_scatter_skipped() -> Iterator[None]:
    """No reduction: each rank keeps its own chunk of its own unreduced input, as if the
    reduce-scatter had been left out (two ranks, inputs ``[1, 2, 3, 4]`` and ``[10, 20, 30,
    40]``: rank 0 keeps ``[1, 2]``, rank 1 ``[30, 40]``)."""

    def tamper(call: GroupCall) -> None:
        call.run()
        own = call.input.reshape(call.size, -1)[call.rank]
        call.output.copy_(own.reshape(call.output.shape))

    with tampered(REDUCE_SCATTER, tamper):
        yield


@contextlib.contextmanager
def all_gather_drops_a_rank() -> Iterator[None]:
    """Rank :data:`DROPPED_RANK`'s shard never reaches the all-gather: it sends zeros, so
    every rank's gathered parameters hold zeros where that shard belongs."""

    def tamper(call: GroupCall) -> None:
        call.run(torch.zeros_like(call.input) if call.rank == DROPPED_RANK else None)

    with tampered(ALL_GATHER, tamper):
        yield


@contextlib.contextmanager
def all_gather_stale() -> Iterator[None]:
    """Each all-gather hands back the result of the previous all-gather of the same shape
    and dtype on the same group (the first one of each is right): a buffer reused before
    the new result was copied in. A parameter gathered again in backward still looks right;
    the next step's forward sees the weights from before the optimizer step."""
    previous: dict[tuple[Any, ...], torch.Tensor] = {}

    def tamper(call: GroupCall) -> None:
        call.run()
        key = (call.group, call.output.shape, call.output.dtype, call.output.device)
        fresh = call.output.detach().clone()
        stale = previous.get(key)
        previous[key] = fresh
        if stale is not None:
            call.output.copy_(stale)

    with tampered(ALL_GATHER, tamper):
        yield
