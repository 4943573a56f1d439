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
* **No torch.compile.** Dynamo and inductor are not thread-safe (their caches and config are
  process-wide), so ranks compiling at once can compile with each other's settings, compute
  wrong results or crash the process. Test compiled models with :class:`FSDPTest`
  (``reffsdp.testing.multiprocess``), one process per rank.

[Note: stopping a rank thread]
Python cannot kill a thread, yet a rank thread still running at the deadline must not live
on into later tests, where it would issue collectives or touch shared state. So once the
deadline passes, :func:`run_threaded` wakes and ends the late ranks:

1. the job is aborted, so ranks waiting in a collective raise ``CollectiveAborted``;
2. ``time.sleep`` in a rank thread waits on the run's stop event (for the length of a run
   ``time.sleep`` is replaced, and rank threads' calls go to that event), so it returns
   early and raises :class:`RankStopped`;
3. after ``_UNWIND_GRACE_S``, a rank still inside its test gets ``RankStopped`` raised in
   its thread (``PyThreadState_SetAsyncExc``), again every ``_RETRY_S`` until it ends or
   ``_STOP_S`` has passed. That ends a rank spinning in Python code.

The failure names every late rank, with its stack at the deadline. A rank blocked in C
code with no timeout (say ``threading.Event().wait()``) cannot be woken: the failure says
so, and the pending ``RankStopped`` ends it the moment it runs Python code again, before it
can touch anything. ``time.sleep`` bound under another name (``from time import sleep``) is
not replaced and, for a sleep longer than the run, is such a case.

[Note: a rank thread ends twice]
``Thread.join`` returns once a thread's Python code is done, but the OS thread then still
runs the destructors of its C++ thread-local objects. torch 2.12 leaves a Python object in
autograd's thread-local storage after every backward; its destructor takes the GIL. If that
happens while the interpreter is shutting down, taking the GIL ends the thread inside a
destructor, and the process aborts (``terminate called without an active exception``, exit
status 134) although every rank passed. So before :func:`run_threaded` returns it waits
until each ended rank thread is gone from the OS as well, and nothing of a run outlives it.

[Note: an interrupted run]
Ctrl-C raises ``KeyboardInterrupt`` in the main thread, usually while :func:`run_threaded`
starts or waits for the ranks. Leaving then would leave the rank threads running into
interpreter shutdown, which aborts the process (``terminate called without an active
exception``). So an interrupted run stops the ranks it started (a thread whose ``start()``
the interrupt cut short included: it begins anyway) as a run past its deadline does (see
[Note: stopping a rank thread]), waits until they are gone from the OS (see [Note: a rank
thread ends twice]), and only then lets the ``KeyboardInterrupt`` go on, without a report
of the ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import sys
import threading
import time
import traceback
import unittest
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from reffsdp.testing import torch_private
from reffsdp.testing.common import DistributedTestMixin
from reffsdp.testing.logical_streams import rank_context
from reffsdp.testing.thread_world import prepare_rank_thread, release_rank_thread, threaded_world
from reffsdp.testing.threaded_pg import (
    BACKEND_NAME,
    CollectiveAborted,
    ThreadedJob,
    register_threaded_backend,
)

# Ending ranks still running at the deadline; see [Note: stopping a rank thread].
_UNWIND_GRACE_S = 1.0  # to unwind after the abort before being interrupted
_RETRY_S = 0.2  # between two interruptions of a rank that is still running
_STOP_S = 5.0  # in all, before a rank that will not end is reported as such

# In a rank thread, ``.stop``: the run's stop event; see [Note: stopping a rank thread].
_rank_thread = threading.local()


class RankStopped(BaseException):
    """Raised in a rank thread still running at its run's deadline, to end it.

    A ``BaseException``, so that a test's ``except Exception`` does not swallow it.
    """


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
    __tracebackhide__ = True  # pytest shows the ranks' frames, not the harness's
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    register_threaded_backend()
    run = _ThreadedRun(fn, world_size, timeout_s)
    with threaded_world(), _sleep_ends_with_the_run():
        stacks, unstoppable = run.start_and_wait()
    _raise_for_outcomes(run.outcomes, stacks, timeout_s, unstoppable)


class _ThreadedRun:
    """One :func:`run_threaded`: what its main thread and its rank threads share."""

    def __init__(self, fn: Callable[[int], None], world_size: int, timeout_s: float) -> None:
        self.fn = fn
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.store = dist.HashStore()
        self.job = ThreadedJob.for_store(self.store)
        self.stop = threading.Event()
        self.outcomes: dict[int, _RankOutcome] = {}
        self.in_test: set[int] = set()  # ranks that may be interrupted: not yet cleaning up

    def record_failure(self, rank: int, exc: BaseException) -> None:
        self.outcomes.setdefault(rank, _RankOutcome(exc, traceback.format_exc()))
        self.job.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

    def rank_main(self, rank: int) -> None:
        # Abort before destroying the group: peers must see a failure as an abort (a
        # consequence), not as this rank leaving the group early (a bug of its own).
        __tracebackhide__ = True  # pytest leaves this frame out of a rank's traceback
        prepare_rank_thread()
        _rank_thread.stop = self.stop
        world = torch_private.c10d_world()  # this run's (see threaded_world)
        self.in_test.add(rank)
        try:
            try:
                dist.init_process_group(
                    BACKEND_NAME,
                    rank=rank,
                    world_size=self.world_size,
                    store=self.store,
                    timeout=timedelta(seconds=self.timeout_s),
                )
                with rank_context(rank):  # logical streams, under simulated_streams()
                    self.fn(rank)
            finally:
                self.in_test.discard(rank)
        except BaseException as exc:  # reported by the main thread
            self.record_failure(rank, exc)
        finally:
            try:
                # A rank ended late may get here after the run has put c10d's own world
                # back (see [Note: stopping a rank thread]): that world is not its to touch.
                if torch_private.c10d_world() is world and dist.is_initialized():
                    dist.destroy_process_group()  # unless the test destroyed it already
            except BaseException as exc:
                self.record_failure(rank, exc)
            release_rank_thread()

    def start_and_wait(self) -> tuple[dict[int, str], list[int]]:
        """Start the rank threads and wait for them: the stacks of those past the deadline
        and the ranks that would not end even when stopped."""
        threads = [
            threading.Thread(target=self.rank_main, args=(rank,), name=f"rank{rank}", daemon=True)
            for rank in range(self.world_size)
        ]
        launched: list[threading.Thread] = []  # start() called: index = rank
        unstoppable: list[int] = []
        try:
            for thread in threads:
                launched.append(thread)
                thread.start()
            stuck = _join_until(threads, time.monotonic() + self.timeout_s)
            stacks = {rank: _stack_of(threads[rank]) for rank in stuck}
            if stuck:
                self.job.abort(f"the run timed out after {self.timeout_s:g}s")
                self.stop.set()
                unstoppable = _end_late_ranks(threads, self.in_test)
            _wait_until_gone_from_the_os(threads, time.monotonic() + _STOP_S)
        except KeyboardInterrupt:  # see [Note: an interrupted run]
            self.job.abort("the run was interrupted")
            self.stop.set()
            started = _until_running(launched, time.monotonic() + _STOP_S)
            _end_late_ranks(started, self.in_test)
            _wait_until_gone_from_the_os(started, time.monotonic() + _STOP_S)
            raise
        return stacks, unstoppable


def _join_until(threads: list[threading.Thread], deadline: float) -> list[int]:
    """Join ``threads`` until ``deadline``; return the indices of those still running."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [index for index, thread in enumerate(threads) if thread.is_alive()]


def _until_running(threads: list[threading.Thread], deadline: float) -> list[threading.Thread]:
    """``threads``, each of which ``start()`` was called for, once each runs (has an ident).

    ``Thread.start`` returns only after the new thread has begun, but an interrupt can end
    it sooner: that thread then still begins, later, and must be stopped and waited for
    like the others (see [Note: an interrupted run]). One that has not begun by
    ``deadline`` is left out, and the list ends before it.
    """
    for index, thread in enumerate(threads):
        while thread.ident is None and time.monotonic() < deadline:
            time.sleep(0.001)
        if thread.ident is None:
            return threads[:index]
    return threads


def _wait_until_gone_from_the_os(threads: list[threading.Thread], deadline: float) -> None:
    """Wait, up to ``deadline``, until the ended ``threads`` have left the OS too.

    See [Note: a rank thread ends twice]. Linux lists a process's live threads under
    ``/proc/self/task``; elsewhere there is nothing to wait on and this returns at once.
    """
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return
    for thread in threads:
        if thread.is_alive() or thread.native_id is None:
            continue
        while os.path.exists(f"{tasks}/{thread.native_id}") and time.monotonic() < deadline:
            time.sleep(0.001)


def _end_late_ranks(threads: list[threading.Thread], in_test: set[int]) -> list[int]:
    """End the rank threads still running; return the ranks that would not end.

    See [Note: stopping a rank thread]; the job is aborted and the stop event set already.
    """
    start = time.monotonic()
    late = _join_until(threads, start + _UNWIND_GRACE_S)
    while late and time.monotonic() < start + _STOP_S:
        for rank in late:
            if rank in in_test:
                _raise_in_thread(threads[rank], RankStopped)
        alive = _join_until([threads[rank] for rank in late], time.monotonic() + _RETRY_S)
        late = [late[index] for index in alive]
    return late


def _raise_in_thread(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Make ``thread`` raise ``exc_type`` when it next runs Python code."""
    assert thread.ident is not None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type)
    )


@contextlib.contextmanager
def _sleep_ends_with_the_run() -> Iterator[None]:
    """Make ``time.sleep`` in rank threads end early, with ``RankStopped``, once stopped."""
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        stop = getattr(_rank_thread, "stop", None)
        if stop is None or seconds < 0:  # not a rank thread, or an error for time.sleep
            real_sleep(seconds)
        elif stop.wait(seconds):
            raise RankStopped("the rank was still sleeping when its run was stopped")

    time.sleep = sleep
    try:
        yield
    finally:
        time.sleep = real_sleep


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"


def _raise_for_outcomes(
    outcomes: dict[int, _RankOutcome],
    stacks: dict[int, str],
    timeout_s: float,
    unstoppable: list[int],
) -> None:
    """Turn what the ranks raised into one exception, causes first; return if all passed.

    ``CollectiveAborted`` is a consequence of another rank's failure or skip, so it is only
    listed; ``RankStopped`` is how a late rank was ended, and its stack at the deadline
    tells more. Skips count when nothing else went wrong.
    """
    __tracebackhide__ = True
    ranks = sorted(outcomes)
    aborted = [r for r in ranks if isinstance(outcomes[r].error, CollectiveAborted)]
    skipped = [r for r in ranks if isinstance(outcomes[r].error, unittest.SkipTest)]
    stopped = [r for r in ranks if isinstance(outcomes[r].error, RankStopped)]
    failed = [r for r in ranks if r not in aborted + skipped + stopped]
    if not failed and not stacks and (skipped or not aborted):
        if skipped:
            raise unittest.SkipTest(f"rank {skipped[0]}: {outcomes[skipped[0]].error}")
        return
    sections = [f"rank {rank} failed:\n{outcomes[rank].traceback}" for rank in failed]
    sections += [
        f"rank {rank} did not finish within {timeout_s:g}s; its stack then:\n{stack}"
        for rank, stack in sorted(stacks.items())
    ]
    sections += [
        f"rank {rank} could not be stopped: it is blocked outside Python code, and ends "
        "(raising RankStopped) as soon as it runs Python code again"
        for rank in unstoppable
    ]
    if aborted:
        # One line each: the collective the rank was in, and why it was aborted.
        lines = [f"ranks {aborted} stopped with CollectiveAborted as a consequence:"]
        lines += [f"  rank {rank}: {outcomes[rank].error}" for rank in aborted]
        sections.append("\n".join(lines))
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
