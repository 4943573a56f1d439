"""Run a test once per rank, one thread per rank, over the threaded process group.

:func:`run_threaded` is the engine: it installs a per-thread c10d world, starts a thread per
rank, initializes the ``"threaded"`` group in each, runs a function and collects what every
rank raised. :class:`FSDPTestMultiThread` puts it behind ``unittest``: each ``test_*`` method
runs on every rank, and the main thread turns the ranks' outcomes into one pass, failure or
skip.

Caveats of ranks that share one process
---------------------------------------
* **Global RNG.** ``torch.manual_seed`` and the default generator are process-wide, so ranks
  draw from one interleaved stream and get different numbers in a racy order. Build models
  on every rank and then call :meth:`FSDPTestMultiThread.sync_module_states` (broadcast from
  rank 0), or draw inputs from a ``torch.Generator`` seeded per rank.
* **Monkeypatches are global.** Patching a module attribute on one rank patches it for all,
  and the last rank to patch wins; counters that patches feed must be shared.
* **One test instance per rank.** Each rank runs the method on a fresh instance of the test
  class, so attributes set in ``setUp`` (which runs on the main thread) are not there; use
  ``perThreadSetUp``/``perThreadTearDown`` for per-rank setup.
* **Collectives serialize** and complete when issued (see [Note: threaded rendezvous]).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import traceback
import unittest
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from reffsdp.testing.common import DistributedTestMixin
from reffsdp.testing.thread_world import prepare_rank_thread, threaded_world
from reffsdp.testing.threaded_pg import (
    BACKEND_NAME,
    CollectiveAborted,
    ThreadedJob,
    register_threaded_backend,
)

# How long ranks that are still running at the deadline get to unwind after the abort.
_UNWIND_GRACE_S = 5.0


class RankFailure(RuntimeError):
    """One or more ranks failed or timed out; the message has each rank's traceback."""

    def __init__(self, message: str, failures: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclasses.dataclass
class _RankOutcome:
    error: BaseException
    traceback: str


def run_threaded(fn: Callable[[int], None], world_size: int, *, timeout_s: float = 120.0) -> None:
    """Call ``fn(rank)`` on ``world_size`` threads, each with an initialized threaded group.

    Raises :class:`RankFailure` naming every rank that raised (with its traceback) or did not
    finish within ``timeout_s``, and ``unittest.SkipTest`` when ranks skipped and none
    failed. When a rank raises, the others' pending and later collectives raise
    ``CollectiveAborted`` instead of waiting for it. c10d's global state is restored before
    this returns.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    register_threaded_backend()
    store = dist.HashStore()
    job = ThreadedJob.for_store(store)
    outcomes: dict[int, _RankOutcome] = {}

    def record_failure(rank: int, exc: BaseException) -> None:
        outcomes.setdefault(rank, _RankOutcome(exc, traceback.format_exc()))
        job.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

    def rank_main(rank: int) -> None:
        # Abort before destroying the group: peers must see a failure as an abort (a
        # consequence), not as this rank leaving the group early (a bug of its own).
        prepare_rank_thread()
        try:
            dist.init_process_group(
                BACKEND_NAME,
                rank=rank,
                world_size=world_size,
                store=store,
                timeout=timedelta(seconds=timeout_s),
            )
            fn(rank)
        except BaseException as exc:  # reported by the main thread
            record_failure(rank, exc)
        finally:
            try:
                if dist.is_initialized():  # the test may have destroyed it already
                    dist.destroy_process_group()
            except BaseException as exc:
                record_failure(rank, exc)

    with threaded_world():
        threads = [
            threading.Thread(target=rank_main, args=(rank,), name=f"rank{rank}", daemon=True)
            for rank in range(world_size)
        ]
        for thread in threads:
            thread.start()
        stuck = _join_until(threads, time.monotonic() + timeout_s)
        stacks = {rank: _stack_of(threads[rank]) for rank in stuck}
        if stuck:
            job.abort(f"the run timed out after {timeout_s:.0f}s")
            _join_until(threads, time.monotonic() + _UNWIND_GRACE_S)
    _raise_for_outcomes(outcomes, stacks, timeout_s)


def _join_until(threads: list[threading.Thread], deadline: float) -> list[int]:
    """Join ``threads`` until ``deadline``; return the indices of those still running."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [index for index, thread in enumerate(threads) if thread.is_alive()]


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"


def _raise_for_outcomes(
    outcomes: dict[int, _RankOutcome], stacks: dict[int, str], timeout_s: float
) -> None:
    """Turn what the ranks raised into one exception, causes first; return if all passed.

    ``CollectiveAborted`` is a consequence of another rank's failure or skip, so it is only
    listed. Skips count when nothing else went wrong.
    """
    ranks = sorted(outcomes)
    aborted = [r for r in ranks if isinstance(outcomes[r].error, CollectiveAborted)]
    skipped = [r for r in ranks if isinstance(outcomes[r].error, unittest.SkipTest)]
    failed = [r for r in ranks if r not in aborted and r not in skipped]
    if not failed and not stacks and (skipped or not aborted):
        if skipped:
            raise unittest.SkipTest(f"rank {skipped[0]}: {outcomes[skipped[0]].error}")
        return
    sections = [f"rank {rank} failed:\n{outcomes[rank].traceback}" for rank in failed]
    sections += [
        f"rank {rank} did not finish within {timeout_s:.0f}s; its stack then:\n{stack}"
        for rank, stack in sorted(stacks.items())
    ]
    if aborted:
        sections.append(f"ranks {aborted} stopped with CollectiveAborted as a consequence")
        if not failed and not stacks:  # no cause on record: show what the ranks saw
            sections.append(f"rank {aborted[0]}:\n{outcomes[aborted[0]].traceback}")
    failures = {rank: outcome.error for rank, outcome in outcomes.items()}
    raise RankFailure("\n".join(sections), failures)


class FSDPTestMultiThread(DistributedTestMixin, unittest.TestCase):
    """``unittest`` base whose ``test_*`` methods run once per rank, each in its own thread.

    Inside a test, ``self.rank``, ``self.world_size``, ``self.device`` and
    ``self.run_subtests`` behave as in the multi-process harness. Override ``world_size``
    for another size and ``timeout_s`` for another deadline. A rank that raises fails the
    test with its rank number and traceback; ``self.skipTest`` on a rank skips the test.
    See the module docstring for what ranks sharing one process implies.
    """

    timeout_s: float = 120.0

    def _callTestMethod(self, method: Callable[[], object]) -> None:
        # unittest calls this to run the test body; we run it on every rank instead.
        name = self._testMethodName
        run_threaded(
            lambda rank: self._run_on_rank(name), self.world_size, timeout_s=self.timeout_s
        )

    def _run_on_rank(self, name: str) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        case = type(self)(name)
        case.perThreadSetUp()
        try:
            getattr(case, name)()
        finally:
            case.perThreadTearDown()
