"""Logical CUDA streams on CPU: under ``reffsdp.testing.simulated_streams()`` a CPU run takes
the calls the CUDA branch of ``reffsdp/core/streams.py`` takes, on threaded ranks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from reffsdp import fully_shard
from reffsdp.core import streams
from reffsdp.testing import logical_streams
from reffsdp.testing.logical_streams import StreamObserver, current_rank
from reffsdp.testing.models import MLPBlocks, init_deterministic
from reffsdp.testing.multithread import run_threaded

pytestmark = [pytest.mark.streams, pytest.mark.multithread]
pytest_plugins = ["reffsdp.testing.pytest_plugin"]

CPU = torch.device("cpu")
DIM = 8


class Launches(StreamObserver):
    """Which stream each op and collective was queued on (with the core's phase), and which
    stream waited for which."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()
        self.waits: set[tuple[str, str]] = set()

    def on_launch(self, stream, tick, op, reads, writes) -> None:
        phases = stream.rank.phases
        self.seen.add((stream.name, phases[-1] if phases else op))

    def on_wait(self, stream, source) -> None:
        self.waits.add((stream.name, source.name if source is not None else "?"))


def _train_fully_shard(steps: int = 2) -> list[float]:
    model = init_deterministic(MLPBlocks(DIM, (2, 3)))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(mesh.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, DIM, generator=generator)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def test_events_and_waits_order_streams(simulated_streams):
    backend = streams.backend_for(CPU)
    compute, side = backend.current_stream(CPU), backend.new_stream(CPU, name="side")
    rank = current_rank()
    tick = rank.launch(compute, "an op")
    assert side.clock.get(compute.id, 0) < tick  # nothing orders the side stream after it
    event = compute.record_event()
    rank.launch(compute, "a later op")
    side.wait_event(event)
    assert side.clock[compute.id] == tick  # after the event's op, not the later one
    assert rank.host.clock.get(compute.id, 0) < tick
    event.synchronize()
    assert rank.host.clock[compute.id] == tick
    with backend.use_stream(side):
        assert backend.current_stream(CPU) is side
        side_tick = rank.launch(backend.current_stream(CPU), "on the side")
    compute.wait_stream(side)
    assert compute.clock[side.id] == side_tick


def test_a_run_takes_the_cuda_branch_and_computes_the_same():
    """All-gathers are issued from the side stream (rule 1 orders it after compute) and
    run on the group's comm stream, as are reduce-scatters, issued from the compute stream;
    copy-out waits (rule 2). The losses are those of a run without streams."""
    seen: dict[int, Launches] = {}

    def on_rank(rank: int) -> None:
        seen[rank] = Launches()
        current_rank().observers.append(seen[rank])
        losses[rank] = _train_fully_shard()

    losses: dict[int, list[float]] = {}
    with logical_streams.simulated_streams() as report:
        run_threaded(on_rank, 2)
    simulated = dict(losses)
    run_threaded(lambda rank: losses.__setitem__(rank, _train_fully_shard()), 2)
    assert simulated == losses
    assert sorted(rank.label for rank in report.ranks) == ["main", "rank 0", "rank 1"]
    for rank in (0, 1):
        assert {("comm [0, 1]", "all-gather"), ("comm [0, 1]", "reduce-scatter")} <= seen[rank].seen
        assert {
            ("all-gather", "compute"),  # rule 1
            ("comm [0, 1]", "all-gather"),  # issued from the side stream
            ("comm [0, 1]", "compute"),  # reduce-scatters, from the compute stream
            ("compute", "comm [0, 1]"),  # the work waited
            ("compute", "all-gather"),  # rule 2
        } <= seen[rank].waits
    assert streams.backend_for(CPU) is streams.HOST  # taken out again
