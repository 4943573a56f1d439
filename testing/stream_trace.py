"""A Chrome trace of the simulated streams: the overlap a GPU run would get.

:class:`StreamLog` records, per rank thread, every op queued on a logical stream and every
wait (see [Note: logical streams] in ``logical_streams``); :func:`write_chrome_trace` lays
them out in time and writes a Chrome trace (JSON in the Trace Event format, for
``chrome://tracing`` or https://ui.perfetto.dev): a process per rank, a row per stream
(``compute``, ``all-gather``, one ``comm`` row per process group, ``host``), the core's
phases as slices (copy-in, all-gather, copy-out, compute and backward, reduce-scatter,
all-reduce) and each wait of one stream for another as an arrow.

[Note: the simulated schedule]
The host ran every op at once, in issue order; the trace places each op where a GPU would
run it instead: on its stream, after the stream's previous op, after whatever the stream
waited for, and no earlier than the host launched it. The host spends ``launch_us`` on each
launch, runs ops on host memory itself, and a wait of the host (``synchronize``, reading a
result) holds it until the work waited for is done. How long each piece takes comes from a
:class:`CostModel`, not from the clock (CPU times of ranks that share two cores are mostly
noise): an op costs a fixed overhead plus its bytes at a memory bandwidth plus its
floating-point operations (where torch's flop counter knows them) at a compute rate; a
collective a latency plus its bytes at a link bandwidth. So the trace is a model, not a
measurement, the same on every run: it shows which work the stream rules let run at the
same time, each piece with a plausible length, and every edge that orders two streams.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from reffsdp.core import torch_internals

from .stream_types import RankStreams, SimStream, SimulatedStreams

# Rows in this order, top to bottom; the rest (user streams) after them.
_ROW_ORDER = ("compute", "all-gather", "comm", "host")


@dataclasses.dataclass(frozen=True)
class OpCost:
    """What an op does, for the cost model: its floating-point operations and the bytes it
    reads, writes and allocates (a collective: the bytes it moves)."""

    flops: int = 0
    nbytes: int = 0


@dataclasses.dataclass(frozen=True)
class CostModel:
    """How long things take in the trace (see [Note: the simulated schedule]); the defaults
    are a GPU's orders of magnitude, and a host's for ops on host memory."""

    launch_us: float = 2.0  # the host, per op it launches
    op_us: float = 2.0  # every op, on top of its bytes and operations
    memory_gb_per_s: float = 500.0
    tflops: float = 20.0
    host_gb_per_s: float = 10.0  # ops on host memory (an offloaded optimizer)
    latency_us: float = 10.0  # every collective, on top of its bytes
    link_gb_per_s: float = 20.0

    def op(self, cost: OpCost, *, on_host: bool) -> float:
        """Microseconds an op takes."""
        gb_per_s = self.host_gb_per_s if on_host else self.memory_gb_per_s
        return self.op_us + cost.nbytes / (gb_per_s * 1e3) + cost.flops / (self.tflops * 1e6)

    def collective(self, cost: OpCost) -> float:
        return self.latency_us + cost.nbytes / (self.link_gb_per_s * 1e3)


@dataclasses.dataclass(frozen=True)
class Launch:
    stream: SimStream
    label: str  # the slice it belongs to
    cost: OpCost


@dataclasses.dataclass(frozen=True)
class Wait:
    stream: SimStream  # the stream (or host) that waits
    clock: dict[int, int]  # up to which op of each stream
    source: SimStream | None


class StreamLog:
    """One rank's ops and waits, in issue order, for the trace."""

    def __init__(self, rank: RankStreams) -> None:
        self.rank = rank
        self.entries: list[Launch | Wait] = []
        self.start = 0  # entries before it are laid out but not drawn (see start_here)

    def start_here(self) -> None:
        """Draw only what comes after this point (earlier steps still set the streams up)."""
        self.start = len(self.entries)

    def on_launch(self, stream, tick, op, reads, writes, cost) -> None:
        self.entries.append(Launch(stream, self._label(stream, op), cost))

    def on_wait(self, stream, clock, source) -> None:
        self.entries.append(Wait(stream, dict(clock), source))

    def _label(self, stream: SimStream, op: str) -> str:
        """A collective's kind; else the core's phase; else the stream's kind of work."""
        if stream.name.startswith("comm"):
            return op
        if self.rank.phases:
            return self.rank.phases[-1]
        if stream.name == "compute":
            return "backward" if torch_internals.in_backward() else "compute"
        if stream.name == "all-gather":
            return "copy-in"  # the buffer's allocation, casts of the shards
        if stream.name == "host":
            return "host"  # e.g. an optimizer stepping offloaded parameters
        return op


# -- laying the log out in time ------------------------------------------------------------


@dataclasses.dataclass
class _Slice:
    stream: SimStream
    name: str
    start: float
    end: float
    ops: int = 1


@dataclasses.dataclass(frozen=True)
class _Flow:
    source: SimStream
    source_us: float
    stream: SimStream
    at_us: float


class _Schedule:
    """Replays one rank's log (see [Note: the simulated schedule])."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.host_us = 0.0
        self.free_us: dict[int, float] = {}  # per stream: when its queued work ends
        self.ends: dict[int, list[float]] = {}  # per stream: end of its op i at [i - 1]
        self.slices: list[_Slice] = []
        self.flows: list[_Flow] = []
        self.drawing = True  # False: lay out, draw nothing (before StreamLog.start)

    def launch(self, entry: Launch) -> None:
        stream, on_host = entry.stream, entry.stream.name == "host"
        if on_host:
            start = self.host_us
        else:
            self.host_us += self.model.launch_us
            start = max(self.free_us.get(stream.id, 0.0), self.host_us)
        if stream.name.startswith("comm"):
            end = start + self.model.collective(entry.cost)
        else:
            end = start + self.model.op(entry.cost, on_host=on_host)
        if on_host:
            self.host_us = end
        self.free_us[stream.id] = end
        self.ends.setdefault(stream.id, []).append(end)
        if self.drawing:
            self._add_slice(stream, entry.label, start, end)

    def wait(self, entry: Wait) -> None:
        ready = self._done_us(entry.clock)
        stream = entry.stream
        if stream.name == "host":
            self.host_us = max(self.host_us, ready)
        else:
            self.free_us[stream.id] = max(self.free_us.get(stream.id, 0.0), ready)
        source = entry.source
        if not self.drawing or source is None or source is stream:
            return
        if source.id in entry.clock:
            source_us = self._done_us({source.id: entry.clock[source.id]})
            if source_us > 0:
                self.flows.append(_Flow(source, source_us, stream, ready))

    def _done_us(self, clock: dict[int, int]) -> float:
        """When the work ``clock`` covers is done."""
        done = 0.0
        for sid, tick in clock.items():
            ends = self.ends.get(sid)
            if ends and tick > 0:
                done = max(done, ends[min(tick, len(ends)) - 1])
        return done

    def _add_slice(self, stream: SimStream, name: str, start: float, end: float) -> None:
        """A slice, or the stream's last one made longer: same name, no gap (the host's gaps
        are its launches)."""
        gap = self.model.launch_us * 1.5 if stream.name == "host" else 1e-6
        for last in reversed(self.slices[-8:]):
            if last.stream is stream:
                if last.name == name and start - last.end <= gap:
                    last.end, last.ops = end, last.ops + 1
                    return
                break
        self.slices.append(_Slice(stream, name, start, end))


# -- writing the trace -----------------------------------------------------------------------


def write_chrome_trace(report: SimulatedStreams, path: str, model: CostModel) -> dict[str, Any]:
    """Write the trace of every rank of ``report`` to ``path``; the trace, as written."""
    events: list[dict[str, Any]] = []
    flow_ids = iter(range(1, 1 << 30))
    ranks = [rank for rank in report.ranks if rank.log.entries[rank.log.start :]]
    for pid, rank in enumerate(sorted(ranks, key=lambda r: r.label)):
        schedule = _Schedule(model)
        origin = _replay(schedule, rank.log)
        events += _metadata(pid, rank)
        events += _slices(pid, schedule.slices, origin)
        events += _flows(pid, schedule, origin, flow_ids)
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    with open(path, "w") as file:
        json.dump(trace, file)
    return trace


def _replay(schedule: _Schedule, log: StreamLog) -> float:
    """Lay out the whole log, drawing from ``log.start`` on; when the first slice drawn
    starts (the trace's zero)."""
    for index, entry in enumerate(log.entries):
        schedule.drawing = index >= log.start
        if isinstance(entry, Launch):
            schedule.launch(entry)
        else:
            schedule.wait(entry)
    return min((piece.start for piece in schedule.slices), default=0.0)


def _metadata(pid: int, rank: RankStreams) -> Iterator[dict[str, Any]]:
    yield {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": rank.label}}
    for stream in rank.streams:
        role = stream.name.split(" ")[0]
        order = _ROW_ORDER.index(role) if role in _ROW_ORDER else len(_ROW_ORDER)
        yield {"ph": "M", "pid": pid, "tid": stream.id, "name": "thread_name",
               "args": {"name": stream.name}}  # fmt: skip
        yield {"ph": "M", "pid": pid, "tid": stream.id, "name": "thread_sort_index",
               "args": {"sort_index": order * 1000 + stream.id}}  # fmt: skip


def _slices(pid: int, slices: list[_Slice], origin: float) -> Iterator[dict[str, Any]]:
    for piece in slices:
        yield {
            "ph": "X",
            "pid": pid,
            "tid": piece.stream.id,
            "name": piece.name,
            "cat": piece.stream.name.split(" ")[0],
            "ts": piece.start - origin,
            "dur": max(piece.end - piece.start, 0.001),
            "args": {"ops": piece.ops},
        }


def _flows(
    pid: int, schedule: _Schedule, origin: float, ids: Iterator[int]
) -> Iterator[dict[str, Any]]:
    """An arrow per wait, from the end of the op waited for to the waiting stream's next op
    (waits with nothing to point at left out)."""
    last_start: dict[int, float] = {}
    for piece in schedule.slices:
        last_start[piece.stream.id] = piece.start
    for flow in schedule.flows:
        if flow.source_us < origin or last_start.get(flow.stream.id, -1.0) < flow.at_us - 1e-6:
            continue
        flow_id = next(ids)
        common = {"pid": pid, "name": "wait", "cat": "wait", "id": flow_id}
        yield {**common, "ph": "s", "tid": flow.source.id, "ts": flow.source_us - origin - 0.001}
        yield {**common, "ph": "f", "tid": flow.stream.id, "ts": flow.at_us - origin}
