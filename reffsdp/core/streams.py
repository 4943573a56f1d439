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
compute still overlaps them. Three more rules keep reductions and offloading safe:

4. Work on another stream reads only what that stream is ordered after: a reduction is
   issued from the stream that produced its input (the compute stream), its result is read
   after its work is waited for, and ``run_on_stream`` makes its stream wait for the
   current one first (and the current one wait for it after).
5. A reduce-scatter's input is allocated on the compute stream and read by the backend's
   stream: it is held until the collective has completed, or the caching allocator could
   hand its memory to the next allocation on the compute stream while it is still read.
6. The host touches offloaded memory (the optimizer reads the gradients and writes the
   shards) only after the device is done with it: the end of backward synchronizes the
   event recorded behind the gradients' non-blocking copies to the host, which comes after
   the copies of the shards to the device too (they were copied out, rule 2).

``reffsdp.testing.simulated_streams()`` checks all six on CPU (see [Note: stream backends]):
it reports each unordered read, write and reuse of memory with the rule that prevents it.

On CPU all of this collapses: there is no side stream, events are ``None`` and every wait
is a no-op; the code path is the same.

[Note: stream backends]
Nothing above this module asks which device it runs on to decide about streams: it asks
the device's :class:`StreamBackend` (:func:`backend_for`). A backend makes streams, tells
the current one, switches it, runs a collective, and copies between host and device;
streams and events are the backend's own objects with CUDA's methods (``wait_stream``,
``wait_event``, ``record_event``, ``synchronize``). Three backends:

* CUDA: ``torch.cuda`` streams and events.
* the host's (CPU): no streams (``None``), every wait a no-op, collectives complete when
  issued (see [Note: collectives on CPU]); other accelerators get no side streams either,
  but their work runs behind the host as on CUDA.
* a simulated one, which ``reffsdp.testing.simulated_streams()`` installs for CPU while it
  runs (:func:`cpu_backend`): logical streams with CUDA's semantics, so a CPU run takes
  every call the CUDA branch takes and a checker can tell whether each read, write and
  free is ordered after the work it depends on.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


class StreamBackend:
    """A device without streams: the host's, or an accelerator's we run no side stream on.

    ``runs_inline``: the host runs the device's work as it is issued (CPU), so collectives
    complete when issued; otherwise work queues behind the host, and host memory is separate
    from the device's (CPU offload means something).
    """

    def __init__(self, *, runs_inline: bool) -> None:
        self.runs_inline = runs_inline
        self.separate_host_memory = not runs_inline

    def new_stream(self, device: torch.device, *, priority: int = 0, name: str = "") -> Any:
        """A new stream (``None`` without streams); ``name`` is for reports and traces."""
        return None

    def current_stream(self, device: torch.device) -> Any:
        return None

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current for the enclosed work."""
        return contextlib.nullcontext()

    def is_stream(self, obj: Any) -> bool:
        return False

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
        """Issue a collective (``call()``) that reads ``reads`` and writes ``writes``."""
        return call()

    def to_host(
        self, tensor: torch.Tensor, *, non_blocking: bool = False, pin: bool = False
    ) -> torch.Tensor:
        """A host copy of ``tensor``, queued on the current stream (pinned if ``pin``)."""
        host = tensor.to("cpu", non_blocking=non_blocking)
        return host.pin_memory() if pin else host

    def to_device(
        self, tensor: torch.Tensor, device: torch.device, *, non_blocking: bool = False
    ) -> torch.Tensor:
        """A copy of host ``tensor`` on ``device``, queued on the current stream."""
        return tensor.to(device, non_blocking=non_blocking)

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host ``tensor`` in pinned memory: itself if it is there already, else a copy."""
        return tensor if tensor.is_pinned() else tensor.pin_memory()


class CudaBackend(StreamBackend):
    """``torch.cuda`` streams and events."""

    def __init__(self) -> None:
        super().__init__(runs_inline=False)

    def new_stream(self, device, *, priority=0, name=""):
        return torch.cuda.Stream(device=device, priority=priority)

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def is_stream(self, obj):
        return isinstance(obj, torch.cuda.Stream)


CUDA = CudaBackend()
HOST = StreamBackend(runs_inline=True)
NO_SIDE_STREAMS = StreamBackend(runs_inline=False)  # accelerators other than CUDA

# The CPU's backend: HOST, or a simulated one while ``cpu_backend`` installs it (see
# [Note: process-wide state] in ``reffsdp``).
_cpu: StreamBackend = HOST


def backend_for(device: torch.device) -> StreamBackend:
    """The backend that runs ``device``'s work (see [Note: stream backends])."""
    if device.type == "cuda":
        return CUDA
    if device.type == "cpu":
        return _cpu
    return NO_SIDE_STREAMS


@contextlib.contextmanager
def cpu_backend(backend: StreamBackend) -> Iterator[StreamBackend]:
    """Run CPU work through ``backend`` inside the block (one at a time per process)."""
    global _cpu
    if _cpu is not HOST:
        raise RuntimeError("a CPU stream backend is installed already; they do not nest")
    _cpu = backend
    try:
        yield backend
    finally:
        _cpu = HOST


class AllGatherStream:
    """The side stream all-gathers are issued on, for one root's groups."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.backend = backend_for(device)
        self.stream: Any = self.backend.new_stream(device, priority=-1, name="all-gather")
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
        with self.backend.use_stream(self.stream):
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
            self.stream.wait_stream(self.backend.current_stream(self.device))

    def consumed(self, buffer: torch.Tensor) -> None:
        """Rule 3: ``buffer`` was just copied out on the compute stream; keep it until safe."""
        if self.stream is None:
            return
        self._deferred = (buffer, self.backend.current_stream(self.device).record_event())


def wait_event_on_current_stream(event: Any, device: torch.device) -> None:
    """Rule 2: ``device``'s current stream waits for ``event`` (no-op for ``None``)."""
    if event is not None:
        backend_for(device).current_stream(device).wait_event(event)


def record_on_current_stream(device: torch.device) -> Any:
    """An event after the work queued so far on ``device``'s current stream (or ``None``)."""
    stream = backend_for(device).current_stream(device)
    return None if stream is None else stream.record_event()


def run_on_stream(stream: Any, fn: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> None:
    """Call ``fn(tensor)`` on ``stream`` (ordered after the current stream's work, and the
    current stream then waits for it); ``None`` or a stream of no backend calls it inline."""
    backend = backend_for(tensor.device)
    if stream is None or not backend.is_stream(stream):
        fn(tensor)
        return
    current = backend.current_stream(tensor.device)
    stream.wait_stream(current)  # rule 4
    with backend.use_stream(stream):
        fn(tensor)
    current.wait_stream(stream)  # rule 4
