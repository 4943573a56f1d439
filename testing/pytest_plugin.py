"""pytest fixtures for distributed tests on threaded ranks.

Load it with ``pytest -p reffsdp.testing.pytest_plugin``, or for a whole project in the root
``conftest.py``::

    pytest_plugins = ["reffsdp.testing.pytest_plugin"]

Three fixtures, built on :func:`~reffsdp.testing.multithread.run_threaded` (one thread per
rank over the in-memory threaded process group),
:class:`~reffsdp.testing.comm_counter.CommCounter` and
:func:`~reffsdp.testing.logical_streams.simulated_streams`:

* ``thread_world``: call it with a function of the rank; it runs that function on every
  rank of a fresh threaded world and returns the ranks' return values, in rank order. The
  world size comes from ``@pytest.mark.world_size(N)`` (default 2) or the call's
  ``world_size=``. When ranks raise, the lowest failing rank's exception is raised in the
  test (so ``pytest.raises`` and assertion messages work as usual), with the test's and that
  rank's frames only (the harness's are hidden) and a note naming the other failing ranks,
  one line each.
* ``comm_counter``: ``with comm_counter.count(): ...`` on a rank counts the collectives that
  rank issues in the block; afterwards ``comm_counter[rank]`` is that rank's
  :class:`CommCounter` and ``comm_counter.counts(kind)`` maps each rank to its count.
* ``simulated_streams``: for the test, CPU work runs on logical CUDA streams, each
  ``thread_world`` rank on its own (see :mod:`reffsdp.testing.logical_streams`); the
  fixture's value is the simulation's report.

::

    import pytest, torch, torch.distributed as dist
    from reffsdp.testing import Collective

    @pytest.mark.world_size(4)
    def test_all_gather(thread_world, comm_counter):
        def on_rank(rank):
            gathered = [torch.empty(1) for _ in range(4)]
            with comm_counter.count():
                dist.all_gather(gathered, torch.tensor([float(rank)]))
            return torch.cat(gathered).tolist()

        assert thread_world(on_rank) == [[0.0, 1.0, 2.0, 3.0]] * 4
        assert comm_counter.counts(Collective.ALL_GATHER) == {0: 1, 1: 1, 2: 1, 3: 1}

Ranks share one process: see :mod:`reffsdp.testing.multithread` for what that implies
(one global RNG, global monkeypatches).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from reffsdp.core.comms import Collective

from . import logical_streams as _simulation
from .comm_counter import CommCounter
from .multithread import RankFailure, RankStopped, run_threaded
from .threaded_pg import CollectiveAborted

DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 120.0


class ThreadWorld:
    """Runs a function on every rank of a fresh threaded world; see the module docstring."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s

    def __call__(
        self,
        fn: Callable[[int], Any],
        *,
        world_size: int | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """``[fn(0), fn(1), ...]``, each called on its own rank thread."""
        __tracebackhide__ = True  # pytest shows the test's frames and the rank's
        size = self.world_size if world_size is None else world_size
        results: dict[int, Any] = {}

        def on_rank(rank: int) -> None:
            __tracebackhide__ = True
            results[rank] = fn(rank)

        try:
            run_threaded(on_rank, size, timeout_s=timeout_s or self.timeout_s)
        except RankFailure as failure:
            rank, cause = _first_cause(failure)
            if cause is None:  # ranks timed out or were aborted without a cause
                raise
            if hasattr(cause, "add_note"):  # Python 3.11+
                cause.add_note(_where(rank, size, failure))
            raise cause from None
        return [results[rank] for rank in range(size)]


def _first_cause(failure: RankFailure) -> tuple[int, BaseException | None]:
    """The lowest rank whose error is its own, not the consequence of another rank's."""
    for rank in sorted(failure.failures):
        error = failure.failures[rank]
        if not isinstance(error, (CollectiveAborted, RankStopped)):
            return rank, error
    return -1, None


def _where(rank: int, size: int, failure: RankFailure) -> str:
    """``(raised on rank 0 of 4)``, then one line per other rank that failed on its own."""
    lines = [f"(raised on rank {rank} of {size})"]
    for other in sorted(failure.failures):
        error = failure.failures[other]
        if other != rank and not isinstance(error, (CollectiveAborted, RankStopped)):
            message = next(iter(str(error).splitlines()), "")
            lines.append(f"(rank {other} raised too: {type(error).__name__}: {message})")
    return "\n".join(lines)


class RankCommCounters:
    """One :class:`CommCounter` per rank: the last ``count()`` block each rank opened."""

    def __init__(self) -> None:
        self._counters: dict[int, CommCounter] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def count(self) -> Iterator[CommCounter]:
        """Count this rank's collectives in the block, from zero (rank 0 outside a world)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        counter = CommCounter()
        with self._lock:
            self._counters[rank] = counter
        with counter:
            yield counter

    def __getitem__(self, rank: int) -> CommCounter:
        if rank not in self._counters:
            raise KeyError(
                f"rank {rank} never opened comm_counter.count(); ranks that did: {self.ranks}"
            )
        return self._counters[rank]

    @property
    def ranks(self) -> list[int]:
        return sorted(self._counters)

    def counts(self, kind: Collective | None = None) -> dict[int, Any]:
        """Per rank: the count of ``kind``, or every kind's counts when ``kind`` is None."""
        return {rank: _pick(self[rank].get_comm_counts(), kind) for rank in self.ranks}

    def bytes(self, kind: Collective | None = None) -> dict[int, Any]:
        """Per rank: the bytes of ``kind`` (see comm_counter's [Note: what nbytes means])."""
        return {rank: _pick(self[rank].get_comm_bytes(), kind) for rank in self.ranks}


def _pick(counts: Counter[Collective], kind: Collective | None) -> Any:
    return counts if kind is None else counts[kind]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"world_size(n): ranks of the thread_world fixture (default {DEFAULT_WORLD_SIZE})",
    )


@pytest.fixture
def thread_world(request: pytest.FixtureRequest) -> ThreadWorld:
    """Run a function on every rank of a threaded world; returns results in rank order."""
    marker = request.node.get_closest_marker("world_size")
    world_size = DEFAULT_WORLD_SIZE
    if marker is not None:
        if len(marker.args) != 1 or not isinstance(marker.args[0], int) or marker.args[0] < 1:
            pytest.fail(
                f"write @pytest.mark.world_size(N) with one whole number N >= 1, "
                f"got world_size{marker.args!r}",
                pytrace=False,
            )
        world_size = marker.args[0]
    return ThreadWorld(world_size)


@pytest.fixture
def comm_counter() -> RankCommCounters:
    """Per-rank collective counts: ``with comm_counter.count(): ...`` on each rank."""
    return RankCommCounters()


@pytest.fixture
def simulated_streams() -> Iterator[_simulation.SimulatedStreams]:
    """CPU work on logical streams for the test; the value is the simulation's report."""
    with _simulation.simulated_streams() as report:
        yield report
