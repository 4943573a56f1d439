"""The one place reffsdp issues collectives.

Every all-gather, reduce-scatter, all-reduce and broadcast that reffsdp runs goes through
the functions below. That gives tests a single seam: :func:`intercept` swaps the
collective one rank issues, without monkeypatching module globals. Each is issued through
its device's stream backend, which learns what it reads and writes (see [Note: stream
backends] in :mod:`reffsdp.core.streams`).

Which torch function carries an all-gather or reduce-scatter depends on the release (entry 1
of [Note: torch versions] in :mod:`reffsdp.core.compat`); it is looked up on
``torch.distributed`` at call time, so no deprecation warning reaches users and a test that
monkeypatches ``torch.distributed`` still sees our calls.

[Note: interception is per rank]
Interceptors are keyed by the caller's global rank. Under the threaded process group every
rank is a thread of one process; keying by rank gives each rank's interceptor only its own
calls, exactly as in a multi-process run.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from reffsdp.core import compat, streams

ReduceOp = dist.ReduceOp


class Collective(enum.Enum):
    """Kinds of collective, as counted by the comm counter and seen by interceptors."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    BARRIER = "barrier"
    GATHER = "gather"
    SCATTER = "scatter"
    REDUCE = "reduce"
    # Picklable objects (state-dict metadata): seen by interceptors; the comm counter sees
    # the tensor collectives torch builds them from.
    ALL_GATHER_OBJECT = "all_gather_object"
    BROADCAST_OBJECT = "broadcast_object_list"


def _torch_collective(kind: Collective) -> Callable[..., Any]:
    if kind is Collective.ALL_GATHER:
        return compat.all_gather_single()
    if kind is Collective.REDUCE_SCATTER:
        return compat.reduce_scatter_single()
    if kind is Collective.ALL_REDUCE:
        return dist.all_reduce
    if kind is Collective.BROADCAST:
        return dist.broadcast
    if kind is Collective.ALL_GATHER_OBJECT:
        return dist.all_gather_object
    if kind is Collective.BROADCAST_OBJECT:
        return dist.broadcast_object_list
    if kind is Collective.BARRIER:
        return dist.barrier
    raise ValueError(f"reffsdp issues no {kind.value} collective")


# Reduce ops besides SUM that a backend carries out, by backend name; see
# :func:`supports_reduce_op`. gloo has no PREMUL_SUM.
_REDUCE_OPS: dict[str, frozenset[dist.ReduceOp.RedOpType]] = {
    "nccl": frozenset({dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM}),
    "gloo": frozenset({dist.ReduceOp.AVG}),
}


def register_reduce_ops(backend: str, ops: Iterable[dist.ReduceOp.RedOpType]) -> None:
    """Declare the reduce ops besides SUM that groups of ``backend`` carry out.

    A backend registered outside torch (a test harness's, say) calls this, so that the
    gradient reduction picks ops it supports. Undeclared backends get SUM only.
    """
    _REDUCE_OPS[backend] = frozenset(ops)


def supports_reduce_op(group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType) -> bool:
    """Whether ``group``'s backend carries out ``op`` (``AVG`` or ``PREMUL_SUM``)."""
    return op in _REDUCE_OPS.get(dist.get_backend(group), frozenset())


_interceptors: dict[tuple[Collective, int], Callable[..., Any]] = {}
_interceptors_lock = threading.Lock()


def _caller_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else -1


def _resolve(kind: Collective) -> Callable[..., Any]:
    if _interceptors:
        found = _interceptors.get((kind, _caller_rank()))
        if found is not None:
            return found
    return _torch_collective(kind)


def _issue(
    kind: Collective,
    call: Callable[[], dist.Work | None],
    *,
    group: dist.ProcessGroup,
    reads: list[torch.Tensor],
    writes: list[torch.Tensor],
    async_op: bool,
) -> dist.Work | None:
    """Run ``call`` through the stream backend of the tensors' device (see [Note: stream
    backends] in ``streams``): the collective reads ``reads`` and writes ``writes``."""
    backend = streams.backend_for(writes[0].device)
    return backend.run_collective(
        kind.value, call, group=group, reads=reads, writes=writes, async_op=async_op
    )


@contextlib.contextmanager
def intercept(kind: Collective, fn: Callable[..., Any]) -> Iterator[None]:
    """Route this rank's ``kind`` collectives to ``fn`` while the context is open.

    ``fn`` takes the same arguments as the torch function it stands in for
    (``dist.all_gather_single``, ``dist.reduce_scatter_single``, ``dist.all_reduce``,
    ``dist.broadcast``, ``dist.all_gather_object``, ``dist.broadcast_object_list``,
    ``dist.barrier``) and may call that function itself to let the collective through.
    """
    key = (kind, _caller_rank())
    with _interceptors_lock:
        previous = _interceptors.get(key)
        _interceptors[key] = fn
    try:
        yield
    finally:
        with _interceptors_lock:
            if previous is None:
                del _interceptors[key]
            else:
                _interceptors[key] = previous


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> dist.Work | None:
    """Gather every rank's ``input`` into ``output`` (rank r's input at slice r)."""
    call = _resolve(Collective.ALL_GATHER)
    return _issue(
        Collective.ALL_GATHER,
        lambda: call(output, input, group=group, async_op=async_op),
        group=group,
        reads=[input],
        writes=[output],
        async_op=async_op,
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: Any = ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``input`` over the group and leave this rank's slice in ``output``."""
    call = _resolve(Collective.REDUCE_SCATTER)
    return _issue(
        Collective.REDUCE_SCATTER,
        lambda: call(output, input, op=op, group=group, async_op=async_op),
        group=group,
        reads=[input],
        writes=[output],
        async_op=async_op,
    )


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: Any = ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce ``tensor`` in place over the group."""
    call = _resolve(Collective.ALL_REDUCE)
    return _issue(
        Collective.ALL_REDUCE,
        lambda: call(tensor, op=op, group=group, async_op=async_op),
        group=group,
        reads=[tensor],
        writes=[tensor],
        async_op=async_op,
    )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> dist.Work | None:
    """Copy global rank ``src``'s ``tensor`` to every rank of the group."""
    call = _resolve(Collective.BROADCAST)
    return _issue(
        Collective.BROADCAST,
        lambda: call(tensor, src=src, group=group, async_op=async_op),
        group=group,
        reads=[tensor],
        writes=[tensor],
        async_op=async_op,
    )


def barrier(group: dist.ProcessGroup) -> None:
    """Return once every rank of the group has called it."""
    _resolve(Collective.BARRIER)(group=group)


def all_gather_object(output: list[Any], obj: Any, group: dist.ProcessGroup | None) -> None:
    """Every rank's picklable ``obj``, rank r's at ``output[r]`` (``output`` has one slot per
    rank of the group)."""
    _resolve(Collective.ALL_GATHER_OBJECT)(output, obj, group=group)


def broadcast_object_list(objects: list[Any], src: int, group: dist.ProcessGroup | None) -> None:
    """Replace ``objects``' items on every rank of the group with global rank ``src``'s."""
    _resolve(Collective.BROADCAST_OBJECT)(objects, src=src, group=group)


class Comm(abc.ABC):
    """A user-supplied collective (``set_custom_all_gather`` / ``set_custom_reduce_scatter``)."""

    @abc.abstractmethod
    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Allocate the buffer the collective writes into (or reads from)."""


class AllGather(Comm):
    @abc.abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatter(Comm):
    @abc.abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class DefaultAllGather(AllGather):
    """``torch.empty`` buffers and :func:`all_gather` (so interceptors still see the call)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return all_gather(output_tensor, input_tensor, group, async_op=async_op)


class DefaultReduceScatter(ReduceScatter):
    """``torch.empty`` buffers and :func:`reduce_scatter`."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return reduce_scatter(output_tensor, input_tensor, group, op=op, async_op=async_op)


def same_ranks_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second process group over ``group``'s ranks, created once per group.

    Reduce-scatters on their own group can run concurrently with all-gathers on the
    original one. Only the group's ranks take part in creating it.
    """
    separate = _separate_groups.get(group)
    if separate is None:
        ranks = dist.get_process_group_ranks(group)
        separate = dist.new_group(ranks, use_local_synchronization=True)
        _separate_groups[group] = separate
    return separate


# One separate group per original group, for the life of the original group.
_separate_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)
