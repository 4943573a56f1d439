"""Logical CUDA streams on CPU: the stream backend ``simulated_streams()`` installs.

On CPU the core has no streams (see [Note: stream backends] in ``reffsdp/core/streams.py``),
so a CPU run checks none of the stream rules. Inside ``with simulated_streams() as report:``
the CPU gets a backend with CUDA's operations instead, and the run takes every call the CUDA
branch takes: all-gathers issued on the side stream, the events and waits of rules 1-3,
reduce-scatters and all-reduces on the backend's own streams, offload copies, the kept
buffers. The work itself still runs on the host, in issue order, so results do not change;
what the streams add is *order*: which work a GPU could run at the same time.

[Note: logical streams]
Each rank thread has its own streams: ``compute`` (the current one unless a ``use_stream``
block says otherwise), the streams the core makes (``all-gather``), one ``comm`` stream per
process group (where a collective backend such as NCCL runs collectives) and ``host``, the
host thread itself. Order between them is kept with vector clocks:

* every op queued on a stream ticks that stream's own entry, and the op is stamped
  ``(stream, tick)``;
* a stream's clock says, per stream, up to which tick that stream's work is ordered before
  whatever the stream runs next;
* ``record_event`` copies the stream's clock into the event; ``wait_event`` and
  ``wait_stream`` join the event's (or the other stream's) clock into the waiting stream's;
* the host launches all work, so an op queued on a stream is ordered after everything the
  host did so far: the stream joins the host's clock first. The host learns of a stream's
  work only by waiting for it (``Event.synchronize``, ``Stream.synchronize``, or reading a
  result, such as ``.item()``, which waits for the stream it was computed on).

Work stamped ``(s, t)`` *happens before* the next op on stream ``b`` when ``b``'s clock holds
at least ``t`` for ``s``. Observers of a rank's streams (``RankStreams.observers``) are told
of every op queued and every wait; one is the rank's checker
(:mod:`reffsdp.testing.stream_checker`), which queues every op the rank runs and checks
every read, write and free against that order.

[Note: collectives on logical streams]
A collective backend runs each collective on a stream of its own per process group, after
the work queued so far on the stream it was issued from: the group's ``comm`` stream waits
for the issuing stream, then reads the input and writes the output. Issued synchronously,
the issuing stream then waits for the collective; issued with ``async_op=True``, the stream
current when ``work.wait()`` is called waits for it. That is NCCL's behaviour. The threaded
process group moves the data at once, when the collective is called; that is the host
doing the work early, which changes no order a GPU would see. Each rank's streams and
memory are its own: a collective orders each rank's streams, and nothing one rank touches
is another's, so no edge between ranks is needed (a collective on stream S of every rank is
simply attributed to each rank).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from reffsdp.core import profiling, streams

from .stream_checker import Findings, StreamChecker
from .stream_trace import CostModel, OpCost, StreamLog, write_chrome_trace

Clock = dict[int, int]  # stream id -> last tick of that stream ordered before


def join(into: Clock, other: Clock) -> None:
    """``into`` learns everything ``other`` knows (the element-wise maximum).

    >>> clock = {1: 3, 2: 1}
    >>> join(clock, {2: 4, 3: 1})
    >>> clock
    {1: 3, 2: 4, 3: 1}
    """
    for sid, tick in other.items():
        if into.get(sid, 0) < tick:
            into[sid] = tick


class SimEvent:
    """An event: a copy of its stream's clock when it was recorded (``torch.cuda.Event``'s
    methods)."""

    def __init__(self) -> None:
        self.clock: Clock | None = None  # None: never recorded, waits are no-ops (as CUDA's)
        self.stream: SimStream | None = None

    def record(self, stream: SimStream | None = None) -> None:
        (stream or current_rank().current).record_event(self)

    def wait(self, stream: SimStream | None = None) -> None:
        (stream or current_rank().current).wait_event(self)

    def synchronize(self) -> None:
        """The host waits until the work before the event is done."""
        if self.clock is not None:
            current_rank().host_waits(self.clock, self.stream)

    def query(self) -> bool:
        return True  # the host ran the work already


class SimStream:
    """One logical stream of one rank (``torch.cuda.Stream``'s methods)."""

    def __init__(self, rank: RankStreams, sid: int, name: str, priority: int = 0) -> None:
        self.rank = rank
        self.id = sid
        self.name = name
        self.priority = priority
        self.clock: Clock = {sid: 0}

    def __repr__(self) -> str:
        return f"<stream {self.name!r} of {self.rank.label}>"

    def wait_stream(self, other: SimStream) -> None:
        """Work queued here from now on runs after the work queued on ``other`` so far."""
        self.rank.stream_waits(self, dict(other.clock), other)

    def wait_event(self, event: SimEvent) -> None:
        if event.clock is not None:
            self.rank.stream_waits(self, event.clock, event.stream)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event or SimEvent()
        self.rank.records(self, event)
        return event

    def synchronize(self) -> None:
        self.rank.host_waits(dict(self.clock), self)

    def query(self) -> bool:
        return True


class RankStreams:
    """One rank thread's logical streams and clocks (see [Note: logical streams])."""

    def __init__(self, sim: SimulatedStreams, label: str) -> None:
        self.sim = sim
        self.label = label
        self.streams: list[SimStream] = []
        self.host = self.new_stream("host")
        self.compute = self.new_stream("compute")
        self.current = self.compute
        self._comm: dict[Any, SimStream] = {}
        self.phases: list[str] = []  # the core's phases now open, innermost last
        # What watches the streams (the checker, the trace): see StreamObserver.
        self.observers: list[StreamObserver] = []
        self.checker: StreamChecker | None = None  # set when the thread enters
        self.log = StreamLog(self)  # for the trace
        self.observers.append(self.log)

    def new_stream(self, name: str, priority: int = 0) -> SimStream:
        stream = SimStream(self, self.sim.next_stream_id(), name, priority)
        self.streams.append(stream)
        return stream

    def comm_stream(self, group: Any) -> SimStream:
        """The stream a collective backend runs ``group``'s collectives on."""
        stream = self._comm.get(group)
        if stream is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else "default"
            stream = self._comm[group] = self.new_stream(f"comm {ranks}")
        return stream

    # -- the clocks ------------------------------------------------------------------------

    def launch(
        self,
        stream: SimStream,
        op: str,
        reads: Sequence[torch.Tensor] = (),
        writes: Sequence[torch.Tensor] = (),
        cost: OpCost = OpCost(),  # noqa: B008 (frozen)
    ) -> int:
        """Queue one op on ``stream`` (the host launches it), reading ``reads`` and writing
        ``writes``: its tick."""
        if stream is not self.host:
            join(stream.clock, self.host.clock)
        tick = stream.clock[stream.id] = stream.clock[stream.id] + 1
        for observer in self.observers:
            observer.on_launch(stream, tick, op, reads, writes, cost)
        return tick

    def stream_waits(self, stream: SimStream, clock: Clock, source: SimStream | None) -> None:
        join(stream.clock, self.host.clock)
        join(stream.clock, clock)
        for observer in self.observers:
            observer.on_wait(stream, clock, source)

    def records(self, stream: SimStream, event: SimEvent) -> None:
        join(stream.clock, self.host.clock)
        event.clock, event.stream = dict(stream.clock), stream

    def host_waits(self, clock: Clock, source: SimStream | None) -> None:
        join(self.host.clock, clock)
        for observer in self.observers:
            observer.on_wait(self.host, clock, source)

    @contextlib.contextmanager
    def using(self, stream: SimStream) -> Iterator[None]:
        if stream.rank is not self:
            raise RuntimeError(f"{stream} is not a stream of {self.label}")
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


class StreamObserver:
    """What the checker and the trace are told; each method a no-op here."""

    def on_launch(self, stream: SimStream, tick: int, op: str, reads, writes, cost: OpCost):
        """An op was queued on ``stream`` with ``tick``."""

    def on_wait(self, stream: SimStream, clock: Clock, source: SimStream | None) -> None:
        """``stream`` (or the host) now waits for the work ``clock`` covers, of ``source``
        (the stream waited for, or that recorded the event)."""


class SimWork:
    """A collective's work: ``wait()`` makes the current stream wait for the collective."""

    def __init__(self, work: Any, done: SimEvent) -> None:
        self._work = work
        self._done = done

    def wait(self, timeout: Any = None) -> bool:
        if self._work is not None:
            self._work.wait()
        current_rank().current.wait_event(self._done)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_local = threading.local()  # .rank: the RankStreams of this thread


def current_rank() -> RankStreams:
    """The calling thread's streams; a thread the simulation never entered has none."""
    rank = getattr(_local, "rank", None)
    if rank is None:
        raise RuntimeError(
            f"thread {threading.current_thread().name!r} runs CPU work under "
            "simulated_streams() but has no logical streams: run it inside the "
            "simulated_streams() block, or as a rank of run_threaded inside it"
        )
    return rank


class SimulatedStreams(streams.StreamBackend):
    """The CPU backend of logical streams (see [Note: logical streams])."""

    def __init__(self) -> None:
        super().__init__(runs_inline=False)
        self.ranks: list[RankStreams] = []
        self.findings = Findings()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def next_stream_id(self) -> int:
        return next(self._ids)

    def write_trace(self, path: str, model: CostModel | None = None) -> dict[str, Any]:
        """A Chrome trace of every rank's streams (see ``stream_trace``)."""
        return write_chrome_trace(self, path, model or CostModel())

    @contextlib.contextmanager
    def on_this_thread(self, label: str) -> Iterator[RankStreams]:
        """Give the calling thread its own logical streams for the block."""
        if getattr(_local, "rank", None) is not None:
            raise RuntimeError(f"{label}: this thread has simulated streams already")
        rank = RankStreams(self, label)
        with self._lock:
            self.ranks.append(rank)
        checker = rank.checker = StreamChecker(rank, self.findings)
        rank.observers.append(checker)
        _local.rank = rank
        try:
            with checker:
                yield rank
        finally:
            checker.drain_frees()
            checker.close()
            _local.rank = None

    # -- the backend's operations (see [Note: stream backends]) ----------------------------

    def new_stream(self, device, *, priority=0, name=""):
        return current_rank().new_stream(name or "side", priority)

    def current_stream(self, device):
        return current_rank().current

    def use_stream(self, stream):
        return current_rank().using(stream)

    def is_stream(self, obj):
        return isinstance(obj, SimStream)

    def run_collective(
        self,
        name: str,
        call: Callable[[], Any],
        *,
        group: Any,
        reads: Sequence[torch.Tensor],
        writes: Sequence[torch.Tensor],
        async_op: bool,
    ) -> Any:
        """See [Note: collectives on logical streams]."""
        rank = current_rank()
        issuing, comm = rank.current, rank.comm_stream(group)
        comm.wait_stream(issuing)
        moved = max(sum(t.numel() * t.element_size() for t in ts) for ts in (reads, writes))
        with rank.using(comm):
            rank.launch(comm, name.replace("_", "-"), reads, writes, OpCost(nbytes=moved))
            with rank.checker.paused():  # the backend's own copies are the collective
                work = call()
        done = comm.record_event()
        if not async_op or work is None:
            issuing.wait_event(done)
            return work
        return SimWork(work, done)

    def to_host(self, tensor, *, non_blocking=False, pin=False):
        """A copy in host memory (see [Note: host memory] in ``stream_checker``), written on
        the current stream; unless ``non_blocking``, the host waits for it."""
        rank = current_rank()
        with rank.checker.paused():
            host = torch.empty_like(tensor)
        rank.checker.mark_host(host)
        host.copy_(tensor, non_blocking=non_blocking)
        if not non_blocking:
            rank.host_waits(dict(rank.current.clock), rank.current)
        return host

    def to_device(self, tensor, device, *, non_blocking=False):
        """A copy in device memory, allocated and written on the current stream."""
        rank = current_rank()
        with rank.checker.paused():
            copy = torch.empty_like(tensor)
        rank.checker.allocated(copy, rank.current, host=False, op="aten.empty_like")
        return copy.copy_(tensor, non_blocking=non_blocking)

    def pinned(self, tensor):
        return tensor  # host memory is as good as pinned here


@contextlib.contextmanager
def simulated_streams() -> Iterator[SimulatedStreams]:
    """Run CPU work on logical streams inside the block (the calling thread included) and
    check it; the object returned is the report: ``findings`` (see ``stream_checker``), one
    ``ranks`` entry per thread."""
    sim = SimulatedStreams()
    with contextlib.ExitStack() as stack:
        stack.enter_context(streams.cpu_backend(sim))
        stack.enter_context(profiling.observe_phases(_phase))
        stack.enter_context(_storage_resizes_seen())
        stack.enter_context(sim.on_this_thread("main"))
        yield sim


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    """The core's phase ``name`` on the calling rank (see ``observe_phases``)."""
    rank = getattr(_local, "rank", None)
    if rank is None:
        yield
        return
    rank.phases.append(name)
    try:
        yield
    finally:
        rank.phases.pop()


@contextlib.contextmanager
def _storage_resizes_seen() -> Iterator[None]:
    """``UntypedStorage.resize_`` frees and allocates but is no dispatched op: while the
    simulation runs it tells the calling rank's checker (a process-wide patch, undone after)."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        old = storage.nbytes()
        result = original(storage, size)
        rank = getattr(_local, "rank", None)
        if rank is not None and old != size:
            rank.checker.resized(storage, old, size)
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


def start_trace() -> None:
    """The calling rank's trace starts here (what ran before still sets the streams up); a
    no-op outside a simulation, so the same code runs with and without one."""
    rank = getattr(_local, "rank", None)
    if rank is not None:
        rank.log.start_here()


def rank_context(rank: int) -> contextlib.AbstractContextManager[Any]:
    """For a rank thread of ``run_threaded``: its own logical streams if a simulation runs."""
    backend = streams.backend_for(torch.device("cpu"))
    if isinstance(backend, SimulatedStreams):
        return backend.on_this_thread(f"rank {rank}")
    return contextlib.nullcontext()
