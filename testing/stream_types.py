"""What the stream checker and the trace read of the simulated streams.

``logical_streams`` runs the simulation and hands its streams and ranks to the checker
(``stream_checker``) and the trace (``stream_trace``), which it also imports: they see the
simulation through these protocols, so that no module of the three imports a module that
imports it back.
"""

from __future__ import annotations

from typing import Any, Protocol


class SimStream(Protocol):
    """A logical stream (``logical_streams.SimStream``)."""

    id: int
    name: str
    clock: dict[int, int]  # the stream's vector clock: stream id -> ticks seen


class RankStreams(Protocol):
    """One rank thread's streams (``logical_streams.RankStreams``): the checker runs each op
    it sees on the current (or the host's) stream and makes the host wait; the trace reads
    the log."""

    label: str
    host: SimStream
    current: SimStream
    streams: list[SimStream]
    phases: list[str]
    log: Any  # stream_trace.StreamLog

    def launch(self, stream: SimStream, op: str, reads: Any, writes: Any, cost: Any) -> None: ...

    def host_waits(self, clock: dict[int, int], source: SimStream | None) -> None: ...


class SimulatedStreams(Protocol):
    """A whole simulated run (``logical_streams.SimulatedStreams``): every rank's streams."""

    ranks: list[RankStreams]
