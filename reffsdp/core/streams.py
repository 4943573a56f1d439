"""Streams and events for overlapping all-gathers with compute; a no-op on CPU.

[Note: why all-gathers get their own stream]
A collective waits for whatever the stream it is issued from has queued. Issued from the
compute stream, block i+1's all-gather would wait for block i's compute to finish, and
nothing would overlap. Issued from a side stream that holds no compute, it runs while
block i computes. Three rules keep that safe:

1. Before the first all-gather of an iteration the side stream waits for the compute
   stream (or for the event from ``set_post_optim_event``): the optimizer step that
   updated the shards must be finished before we read them.
2. Copy-out runs on the compute stream after it waits the all-gather's event.
3. The all-gather output buffer is allocated on the side stream and read by copy-out on
   the compute stream. Dropping it at once would let the caching allocator hand the
   memory to the next all-gather on the side stream while copy-out may still be reading
   it. So the last buffer is kept, with an event recorded after its copy-out, and the side
   stream waits for that event before the next all-gather allocates. At most two buffers
   are in flight: the one being consumed and the one being filled.

Reduce-scatters are issued from the compute stream: the gradients they read were just
produced there, and backends run collectives on their own internal streams, so backward
compute still overlaps them.

On CPU all of this collapses: there is no side stream, events are ``None`` and every wait
is a no-op; the code path is the same.

[Note: collectives on CPU]
On CPU a group's all-gather and reduce-scatter complete when they are issued, as torch's
``fully_shard`` and wrapper do there; an explicit ``unshard(async_op=True)`` returns early
and ``set_reduce_scatter_max_input_buffers`` lets reductions overlap again. gloo runs a
collective on its own thread through a temporary as large as the unsharded block (the
all-gather gathers into one and copies it out; the reduce-scatter clones its whole input),
held until the collective completes. Overlapped with the next block's compute, that
temporary sits at the step's memory peak, while the overlap itself buys little: the cores
that would run the collective are busy computing. Measured with ``python -m reffsdp.bench``
(2 ranks on 2 cores): the reduce-scatter's copy raised the 27M Transformer's peak from 98
to 112 MB, the all-gather's the 3.4M model's from 43 to 46 MB, each for under 1% of step
time in paired runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class AllGatherStream:
    """The side stream all-gathers are issued on, for one root's groups."""

    def __init__(self, device: torch.device) -> None:
        self.stream: Any = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device=device, priority=-1)
        self._deferred: tuple[Any, Any] | None = None  # (buffer kept alive, copy-out event)

    @contextlib.contextmanager
    def issuing(self, current: bool = False) -> Iterator[None]:
        """Run the enclosed copy-in and collective on the side stream (rule 3 applied), or
        on the current stream when ``current`` is set."""
        if self.stream is None or current:
            yield
            return
        if self._deferred is not None:
            self.stream.wait_event(self._deferred[1])
            self._deferred = None
        with torch.cuda.stream(self.stream):
            yield

    def on_compute_stream(self, current: bool = False) -> bool:
        """Whether ``issuing(current)`` runs on the compute stream (always on CPU)."""
        return self.stream is None or current

    def record(self) -> Any:
        """An event marking what the side stream has queued so far (``None`` on CPU)."""
        return None if self.stream is None else self.stream.record_event()

    def wait_for_compute(self, event: Any = None) -> None:
        """Rule 1: make the side stream wait for the compute stream (or ``event``)."""
        if self.stream is None:
            return
        if event is not None:
            self.stream.wait_event(event)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def consumed(self, buffer: torch.Tensor) -> None:
        """Rule 3: ``buffer`` was just copied out on the compute stream; keep it until safe."""
        if self.stream is None:
            return
        self._deferred = (buffer, torch.cuda.current_stream(self.stream.device).record_event())


def wait_event_on_current_stream(event: Any) -> None:
    """Rule 2: the compute stream waits for ``event`` (no-op for ``None``)."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def run_on_stream(stream: Any, fn: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> None:
    """Call ``fn(tensor)`` on ``stream`` (ordered after the current stream's work, and the
    current stream then waits for it); ``None`` or a CPU stream calls it inline."""
    if stream is None or not isinstance(stream, torch.cuda.Stream):
        fn(tensor)
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn(tensor)
    current.wait_stream(stream)
