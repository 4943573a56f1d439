"""Counting the collectives a piece of code issues, by kind and by bytes.

::

    with CommCounter() as counter:
        model(inp).sum().backward()
    assert counter.get_comm_counts()[Collective.ALL_GATHER] == 2
    assert counter.get_comm_bytes()[Collective.REDUCE_SCATTER] == 4 * numel

[Note: two ways in]
Collectives reach a counter along two paths.

1. The dispatcher. Process groups written in C++ (gloo, NCCL, the fake group) run every
   collective as a ``c10d`` dispatcher op, and DTensor and functional collectives use the
   ``_c10d_functional`` ops. :class:`CommCounter` is a ``TorchDispatchMode``, so it sees them
   whoever called them: reffsdp, a plain ``torch.distributed`` call, or DTensor.
2. :func:`record_collective`. A process group written in Python (our threaded group)
   overrides the ``ProcessGroup`` methods, and ``torch.distributed`` calls those methods
   directly: no dispatcher op is ever issued. Such a group reports each collective here, on
   the issuing rank's thread.

A collective is counted once. While a counter runs a dispatched collective, reports that
arrive through :func:`record_collective` on the same thread are ignored: they are the same
collective seen from below (a functional collective run on a Python group).

[Note: what nbytes means]
The size of a collective is the size, on one rank, of its whole buffer: for the sharding
collectives that is the unsharded side. All-gather: the output. Reduce-scatter: the input.
All-reduce, broadcast, reduce: the tensor. All-to-all and gather: the input. Scatter: the
output. Barrier: 0. An all-gather and the reduce-scatter of the same parameters therefore
report the same bytes. Lists of tensors (coalesced ops) add up.

[Note: the collectives an implementation issues]
:class:`IssuedCollectives` serves the parity suite when it checks an FSDP implementation
other than reffsdp, which has no comms seam to observe (see [Note: why the engine counts
through the comms seam] in ``suite_rank.py``). It sees what ``torch.distributed``'s
collective functions issue, along both paths above, with the size of the group each ran
on; functional collectives (DTensor's tensor parallelism) are left out, as FSDP does not
issue them, and so is the threaded group's report of one.

[Note: threads and nesting]
Counters are per thread: torch keeps its dispatch-mode stack per thread, and our registry
for :func:`record_collective` is thread-local too, so under the threaded group each rank's
counter sees only its own rank. Counters nest; every open counter on the thread counts.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from reffsdp.core.comms import Collective

from .torch_private import TorchDispatchMode, is_traceable_wrapper_subclass_type

# Where a dispatched op keeps the tensors whose bytes it reports (see [Note: what nbytes
# means]): the index of a positional argument, _RESULT for the op's return value, or None
# for no bytes at all.
_RESULT = "result"

# Ops are named here by namespace and name, without overload; names this torch lacks are
# skipped, so one table serves 2.11 and 2.13. Not listed, on purpose: point-to-point ops
# (send/recv), ``_c10d_functional.wait_tensor`` (a wait, not a collective) and the
# ``_c10d_functional_autograd`` ops, which reach the dispatcher as the plain
# ``_c10d_functional`` ops below, so listing them would count twice.
_COUNTED_OPS: dict[tuple[str, str], tuple[Collective, int | str | None]] = {
    # torch.distributed, through a C++ process group
    ("c10d", "_allgather_base_"): (Collective.ALL_GATHER, 0),
    ("c10d", "allgather_"): (Collective.ALL_GATHER, 0),
    ("c10d", "allgather_coalesced_"): (Collective.ALL_GATHER, 0),
    ("c10d", "allgather_into_tensor_coalesced_"): (Collective.ALL_GATHER, 0),
    ("c10d", "_reduce_scatter_base_"): (Collective.REDUCE_SCATTER, 1),
    ("c10d", "reduce_scatter_"): (Collective.REDUCE_SCATTER, 1),
    ("c10d", "reduce_scatter_tensor_coalesced_"): (Collective.REDUCE_SCATTER, 1),
    ("c10d", "allreduce_"): (Collective.ALL_REDUCE, 0),
    ("c10d", "allreduce_coalesced_"): (Collective.ALL_REDUCE, 0),
    ("c10d", "broadcast_"): (Collective.BROADCAST, 0),
    ("c10d", "alltoall_"): (Collective.ALL_TO_ALL, 1),
    ("c10d", "alltoall_base_"): (Collective.ALL_TO_ALL, 1),
    ("c10d", "barrier"): (Collective.BARRIER, None),
    ("c10d", "monitored_barrier_"): (Collective.BARRIER, None),
    ("c10d", "gather_"): (Collective.GATHER, 1),
    ("c10d", "scatter_"): (Collective.SCATTER, 0),
    ("c10d", "reduce_"): (Collective.REDUCE, 0),
    # functional collectives (DTensor, torch.compile)
    ("_c10d_functional", "all_gather_into_tensor"): (Collective.ALL_GATHER, _RESULT),
    ("_c10d_functional", "all_gather_into_tensor_out"): (Collective.ALL_GATHER, _RESULT),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): (Collective.ALL_GATHER, _RESULT),
    ("_c10d_functional", "reduce_scatter_tensor"): (Collective.REDUCE_SCATTER, 0),
    ("_c10d_functional", "reduce_scatter_tensor_out"): (Collective.REDUCE_SCATTER, 0),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): (Collective.REDUCE_SCATTER, 0),
    ("_c10d_functional", "all_reduce"): (Collective.ALL_REDUCE, 0),
    ("_c10d_functional", "all_reduce_"): (Collective.ALL_REDUCE, 0),
    ("_c10d_functional", "all_reduce_coalesced"): (Collective.ALL_REDUCE, 0),
    ("_c10d_functional", "all_reduce_coalesced_"): (Collective.ALL_REDUCE, 0),
    ("_c10d_functional", "broadcast"): (Collective.BROADCAST, 0),
    ("_c10d_functional", "broadcast_"): (Collective.BROADCAST, 0),
    ("_c10d_functional", "all_to_all_single"): (Collective.ALL_TO_ALL, 0),
}


def all_gather_numel(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """Elements in the all-gather output (= reduce-scatter input) of one FSDP parameter group.

    Each parameter contributes ``world_size`` shards of ``ceil(dim0 / world_size)`` rows,
    the last ones padded: two ranks, shapes ``[(5, 3), (5,)]`` give ``2 * 3 * 3 + 2 * 3``
    = 24. Computed from the shapes alone, so tests can check reffsdp's byte counts against
    it without trusting reffsdp's sharding math.
    """
    return sum(
        world_size * math.ceil(shape[0] / world_size) * math.prod(shape[1:]) for shape in shapes
    )


def counted_op_names() -> list[str]:
    """The dispatcher ops counted on this torch, as ``"namespace.name"``."""
    return [f"{ns}.{name}" for ns, name in _COUNTED_OPS if _find_op(ns, name) is not None]


def _find_op(namespace: str, name: str) -> Any:
    return getattr(getattr(torch.ops, namespace), name, None)


def _packet_table() -> dict[Any, tuple[Collective, int | str | None]]:
    table = {}
    for (namespace, name), entry in _COUNTED_OPS.items():
        packet = _find_op(namespace, name)
        if packet is not None:
            table[packet] = entry
    return table


def _nbytes(value: Any) -> int:
    """Bytes of every tensor in ``value``, which may nest lists and tuples of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


class _ThreadCounters(threading.local):
    """The counters open on this thread, innermost last, and the dispatch in progress."""

    def __init__(self) -> None:
        self.open: list[_OpenOnThisThread] = []
        self.dispatch_depth = 0


_this_thread = _ThreadCounters()


def record_collective(kind: Collective, nbytes: int, group: Any = None) -> None:
    """Report one collective issued on this thread to the active counters.

    For process groups the dispatcher cannot see (see [Note: two ways in]); ``nbytes``
    follows [Note: what nbytes means], ``group`` is the process group it ran on. A no-op
    when no counter is open on this thread.
    """
    if _this_thread.dispatch_depth:
        return
    for counter in _this_thread.open:
        counter._add(kind, nbytes, group)


class _OpenOnThisThread(TorchDispatchMode):
    """A dispatch mode that also hears :func:`record_collective` on its thread while open
    (through its ``_add``)."""

    def __enter__(self):
        super().__enter__()
        _this_thread.open.append(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            _this_thread.open.remove(self)
        finally:
            super().__exit__(*exc_info)


class CommCounter(_OpenOnThisThread):
    """Count the collectives issued on this thread while the context is open.

    Counts and bytes start from zero on every entry. See [Note: two ways in] for what is
    seen and [Note: what nbytes means] for the byte sizes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._packets = _packet_table()
        self._counts: Counter[Collective] = Counter()
        self._bytes: Counter[Collective] = Counter()
        self._sequence: list[tuple[Collective, int]] = []

    def __enter__(self) -> CommCounter:
        self._counts.clear()
        self._bytes.clear()
        self._sequence.clear()
        return super().__enter__()

    def get_comm_counts(self) -> Counter[Collective]:
        """Collectives per kind; kinds never seen read as 0."""
        return Counter(self._counts)

    def get_comm_bytes(self) -> Counter[Collective]:
        """Bytes per kind, summed over that kind's collectives."""
        return Counter(self._bytes)

    def get_total_counts(self) -> int:
        """All collectives of every kind, barriers included."""
        return sum(self._counts.values())

    def get_comm_sequence(self) -> list[tuple[Collective, int]]:
        """``(kind, nbytes)`` of every collective, in the order this rank issued them."""
        return list(self._sequence)

    def _add(self, kind: Collective, nbytes: int, group: Any = None) -> None:
        self._counts[kind] += 1
        self._sequence.append((kind, nbytes))
        if nbytes:  # keep byte-free kinds (barriers) out, so results compare to plain dicts
            self._bytes[kind] += nbytes

    def __torch_dispatch__(
        self, func: Any, types: Iterable[type], args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        # A wrapper subclass such as DTensor must run its own implementation first: the
        # collectives it then issues on its plain local tensors come back through this mode.
        # (Running ``func`` here would hide them, since a mode is off while it dispatches.)
        # Other subclasses, like the FakeTensor of DTensor's shape propagation, pass through.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        entry = self._packets.get(func._overloadpacket)
        if entry is None:
            return func(*args, **kwargs)
        _this_thread.dispatch_depth += 1
        try:
            result = func(*args, **kwargs)
        finally:
            _this_thread.dispatch_depth -= 1
        kind, where = entry
        if where is None:
            nbytes = 0
        else:
            nbytes = _nbytes(result if where == _RESULT else args[where])
        self._add(kind, nbytes)
        return result


class IssuedCollectives(_OpenOnThisThread):
    """Call ``observer(kind, nbytes, group_size)`` at each collective that this thread
    issues through ``torch.distributed`` while the context is open (see [Note: the
    collectives an implementation issues]); ``nbytes`` follows [Note: what nbytes means].
    """

    def __init__(self, observer: Callable[[Collective, int, int], None]) -> None:
        super().__init__()
        self._observer = observer
        self._packets = _packet_table()

    def _add(self, kind: Collective, nbytes: int, group: Any = None) -> None:
        """A collective of the threaded group (reported through :func:`record_collective`)."""
        self._observer(kind, nbytes, dist.get_world_size() if group is None else group.size())

    def __torch_dispatch__(
        self, func: Any, types: Iterable[type], args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # as in CommCounter: DTensor runs its own implementation
        entry = self._packets.get(func._overloadpacket)
        if entry is None:
            return func(*args, **kwargs)
        _this_thread.dispatch_depth += 1  # a threaded group's report of it is not another
        try:
            result = func(*args, **kwargs)
        finally:
            _this_thread.dispatch_depth -= 1
        if func.namespace == "c10d":  # torch.distributed's; _c10d_functional is DTensor's
            kind, where = entry
            nbytes = 0 if where is None else _nbytes(result if where == _RESULT else args[where])
            self._observer(kind, nbytes, _group_size(args))
        return result


def _group_size(args: Sequence[Any]) -> int:
    """The size of the process group a ``c10d`` op's arguments name."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name().endswith(
            "c10d.ProcessGroup"
        ):
            return dist.ProcessGroup.unbox(arg).size()
    raise ValueError("a c10d collective without a process group among its arguments")
