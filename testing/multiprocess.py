"""The multi-process harness: one process per rank, gloo on CPU, NCCL on CUDA.

::

    class TestReduceScatter(FSDPTest):
        @property
        def world_size(self) -> int:
            return 4

        def test_sum(self) -> None:  # runs on every rank
            self.run_subtests({"dtype": [torch.float32, torch.bfloat16]}, self._check_sum)

Unlike torch's harness this one runs on CPU-only machines (gloo). With ``--device cuda``
every rank gets its own GPU, and a test that needs more GPUs than there are is skipped.
A class (``fake_pg = True``) or a method (``@with_fake_pg``) can instead run in the pytest
process itself, as one rank of a fake group of ``world_size`` (see ``fake_pg.py``).

[Note: how a test method reaches the ranks]
The pytest process never runs a test body. There, ``FSDPTest.__init__`` replaces the test
method with a launcher and makes ``setUp``/``tearDown`` no-ops. The launcher starts
``world_size`` rank processes, each given the test's module, class and method names. A rank
imports the module, builds the default process group, builds ``cls(method_name)`` and runs
it with unittest's own machinery, so ``setUp``, the method, ``tearDown`` and cleanups all
run on every rank. Each rank sends back a small report, and the launcher turns the reports
into the test's outcome. Hence test classes must be defined at module level, and
``setUpClass``/``tearDownClass`` run in the pytest process only.

[Note: a test module under torchrun]
Under torchrun or srun (``torchrun --nproc-per-node 2 -m pytest tests/...``) every worker is
a pytest process, and together they are the ranks: a test joins the launched world instead
of spawning (:func:`reffsdp.testing.launch.start_ranks` decides). Each pytest process runs
the same rank code as a spawned rank, on a thread of its own, for its own rank, and judges
the test from its rank's report alone; a test whose ``world_size`` differs from the
launched world's is skipped on every rank, with both sizes, so the ranks stay in step. A
rank that fails or dies ends the others' test within its ``timeout_s`` (the process
groups' timeout, and the launched world's fault board: [Note: failures in a launched
world]). Fake-group tests run in each pytest process as before.

[Note: outcomes]
The first rank to stop abnormally decides. If it skipped, the test is skipped: peers left
waiting in a collective fail only as a consequence. If it failed, the test fails with every
failing rank's number and traceback. Once a rank has stopped abnormally the others get
``_GRACE_S`` seconds to report and are then killed, since they are probably waiting for it.
A test running past ``timeout_s`` fails with the Python stacks of the ranks still running
(``faulthandler`` dumps them on SIGUSR1 before they are killed): they show where it hangs.
Ranks whose collectives cannot match (one rank's n-th collective on a group differs from
another's) are stopped at once, with their stacks, instead of waiting for the timeout. Every
failure names each failing rank's last collective and the collectives some ranks issued and
others did not: see [Note: collective trace] in ``collective_trace.py``.
A failing ``subTest`` ends its rank's test instead of being recorded and passed over: a rank
that went on to the next subtest would issue collectives its peers do not match.

[Note: start-up cost]
A rank process must import torch, which takes seconds. Spawning a fresh interpreter per rank
cost about 2.4 s per test on a 2-core machine, so rank processes come from a
``forkserver`` instead (see [Note: start methods] in ``launch.py``): a server process,
itself started fresh (it never inherits the pytest process's threads or CUDA state), imports
torch, DTensor and dynamo (which the first DTensor a process builds imports, about a
second's work) once, and each rank process is forked from it. A test then costs 0.1-0.2 s
of harness time at world size 2 (0.6 s at 8), group set-up and exit included; the server's
start, about 1.5 s, is paid once per session. The server imports nothing that initializes
CUDA, which a forked child could not use. Keeping rank processes alive across tests
(torch's ``FSDPTestContinuous``) would save little more and would let state leak from one
test into the next, so every test gets fresh processes. Passing ranks meet at a last
barrier before tearing their group down (``_leave_together``).

[Note: rank processes never outlive pytest]
A rank left behind would hold a core until its collectives time out, so each rank process
ends with the pytest process however that ends. When pytest fails a test, is interrupted
(SIGINT) or stops a test, it ends the test's ranks itself (``RankProcesses.close``). When
pytest is killed (SIGKILL, or SIGTERM, which Python does not handle) it cannot, and the
ranks end themselves: see [Note: stopping rank processes] in ``launch.py``. The fork server
ends when pytest does, and its resource tracker once pytest, the fork server and the ranks
have all gone.
"""

from __future__ import annotations

import contextlib
import enum
import faulthandler
import functools
import importlib
import importlib.util
import os
import signal
import sys
import threading
import time
import traceback
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from reffsdp.testing import torch_private
from reffsdp.testing.collective_trace import (
    CollectiveRecorder,
    RankTrace,
    find_mismatch,
    find_unmatched,
    read_trace,
)
from reffsdp.testing.common import DistributedTestMixin
from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.testing.launch import (
    JoinedRank,
    RankFailed,
    RankProcesses,
    RankWorld,
    join_ranks,
    launched_world,
    spawn_ranks,
)
from reffsdp.testing.launched_world import read_launched_env

# Imported by the fork server: [Note: start-up cost].
_PRELOADED = ["torch", "torch.distributed.tensor", torch_private.DYNAMO_MODULE]
_GRACE_S = 2.0  # once a rank stops abnormally, how long the others get to report
_STACK_DUMP_WAIT_S = 2.0  # how long a hung rank may take to write its stacks
_POLL_S = 0.1  # how often the pytest process looks for mismatched collectives

# Set on the thread that runs rank code (a rank process's, or a joined rank's); see [Note: how
# a test method reaches the ranks] and [Note: a test module under torchrun].
_rank_thread = threading.local()


def _running_in_rank() -> bool:
    return getattr(_rank_thread, "running", False)


_F = TypeVar("_F", bound=Callable[..., Any])


def with_fake_pg(test_method: _F) -> _F:
    """Run this test method as one rank of a fake process group, in the pytest process."""
    test_method._reffsdp_fake_pg = True  # type: ignore[attr-defined]
    return test_method


class _Outcome(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    DIED = "exited without reporting"
    TIMED_OUT = "timed out"
    MISMATCHED = "was stopped: the ranks' collectives cannot match"
    STOPPED = "was stopped after another rank stopped"


@dataclass(frozen=True)
class _Report:
    """How one test went on one rank."""

    rank: int
    outcome: _Outcome
    detail: str = ""


@dataclass(frozen=True)
class _TestAddress:
    """How a rank process finds a test: module (by name, else by file), class, method."""

    module: str
    file: str | None
    qualname: str
    method: str

    @classmethod
    def of(cls, case: unittest.TestCase) -> _TestAddress:
        test_class = type(case)
        if "<locals>" in test_class.__qualname__:
            raise TypeError(
                f"{test_class.__qualname__} is defined inside a function; define FSDPTest "
                "classes at module level so that rank processes can import them"
            )
        file = getattr(sys.modules[test_class.__module__], "__file__", None)
        return cls(test_class.__module__, file, test_class.__qualname__, case._testMethodName)

    def load(self) -> unittest.TestCase:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            # pytest's importlib import mode gives test modules names that do not import.
            if self.file is None:
                raise
            spec = importlib.util.spec_from_file_location(self.module, self.file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = module
            spec.loader.exec_module(module)
        found: Any = module
        for name in self.qualname.split("."):
            found = getattr(found, name)
        return found(self.method)


@dataclass(frozen=True)
class _TestRun:
    """What every rank of one test is given."""

    test: _TestAddress
    device_type: str
    timeout_s: float


def _stack_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"stacks-rank{rank}.txt")


def _trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"collectives-rank{rank}.json")


# ---- inside a rank process -------------------------------------------------------------


def _rank_main(world: RankWorld, conn: Connection, run: _TestRun) -> None:
    """A rank process: build the default group, run the test, report how it went."""
    _rank_thread.running = True
    recorder = CollectiveRecorder(_trace_path(world.directory, world.rank))
    recorder.install()
    stack_file = open(_stack_path(world.directory, world.rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        _run_rank(world, conn, run, recorder)
    finally:  # a joined rank's process goes on to the next test
        faulthandler.unregister(signal.SIGUSR1)
        stack_file.close()
        recorder.uninstall()


def _run_rank(world: RankWorld, conn: Connection, run: _TestRun, recorder: CollectiveRecorder):
    try:
        case = run.test.load()
        _init_default_group(world, run)
    except Exception:
        detail = "rank set-up failed:\n" + traceback.format_exc()
        conn.send(_Report(world.rank, _Outcome.FAILED, detail))
        return
    try:
        report = _run_test(case, world.rank)
        conn.send(report)
        if report.outcome is _Outcome.PASSED and dist.is_initialized():
            recorder.closing = True
            _leave_together()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_default_group(world: RankWorld, run: _TestRun) -> None:
    if run.device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
        # NCCL for CUDA tensors; gloo for the CPU tensors tests also communicate.
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
        # The ranks share the machine's cores; more intra-op threads only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.local_world_size))
    world.init_process_group(backend, timedelta(seconds=run.timeout_s))


def _leave_together() -> None:
    """Wait for every rank to finish before any tears its group down.

    A rank that closes its connections while a slower peer is still connecting, or still
    reading its last message, can fail that peer's test. If a peer never comes, it did not
    pass, and its own report says why; the parent then stops this rank.
    """
    with contextlib.suppress(RuntimeError):
        dist.barrier()


def _run_test(case: unittest.TestCase, rank: int) -> _Report:
    result = unittest.TestResult()
    case.run(result)
    # An expected failure is still a failure of this rank: the pytest process, whose
    # launcher carries the expectedFailure mark too, judges the test as a whole.
    problems = result.errors + result.failures + result.expectedFailures
    if problems:
        return _Report(rank, _Outcome.FAILED, "\n".join(text for _, text in problems))
    if result.skipped:
        return _Report(rank, _Outcome.SKIPPED, result.skipped[0][1])
    return _Report(rank, _Outcome.PASSED)


# ---- in the pytest process -------------------------------------------------------------


class _RankProcesses:
    """The rank processes running one test, and what they leave in their shared folder."""

    def __init__(self, run: _TestRun, world_size: int) -> None:
        self._ranks: RankProcesses = spawn_ranks(
            _rank_main,
            world_size,
            (run,),
            start_method="forkserver",  # see [Note: start-up cost]
            preload=_PRELOADED,
            name=f"{run.test.qualname}.{run.test.method}",
        )
        self._reported: set[int] = set()

    def traces(self) -> dict[int, RankTrace]:
        """What each rank that issued a collective issued; see [Note: collective trace]."""
        directory, ranks = self._ranks.directory, range(self._ranks.world_size)
        found = (read_trace(_trace_path(directory, rank), rank) for rank in ranks)
        return {trace.rank: trace for trace in found if trace is not None}

    def wait_for_reports(self, timeout_s: float) -> list[_Report]:
        """Every rank's report, in the order they arrived; see [Note: outcomes]."""
        waiting = set(range(self._ranks.world_size))
        reports: list[_Report] = []
        deadline = time.monotonic() + timeout_s
        while waiting:
            poll_s = min(_POLL_S, max(0.0, deadline - time.monotonic()))
            for rank in self._ranks.ready(waiting, poll_s):
                waiting.discard(rank)
                reports.append(self._receive(rank))
                if reports[-1].outcome is not _Outcome.PASSED:
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
            if waiting and find_mismatch(self.traces()) is not None:
                return reports + self._stopped(sorted(waiting), _Outcome.MISMATCHED)
            if waiting and time.monotonic() >= deadline:
                if any(report.outcome is not _Outcome.PASSED for report in reports):
                    return reports + self._stopped(sorted(waiting), _Outcome.STOPPED)
                why = f"still running after {timeout_s} s"
                return reports + self._stopped(sorted(waiting), _Outcome.TIMED_OUT, why)
        return reports

    def _receive(self, rank: int) -> _Report:
        try:
            report = self._ranks.receive(rank)
        except RankFailed as failure:
            outcome = _Outcome.DIED if failure.silent else _Outcome.FAILED
            report = _Report(rank, outcome, failure.detail)
        self._reported.add(rank)
        return report

    def _stopped(self, ranks: list[int], outcome: _Outcome, why: str = "") -> list[_Report]:
        """Reports for ranks still running; but for ``STOPPED``, with their Python stacks."""
        if outcome is _Outcome.STOPPED:
            return [_Report(rank, outcome) for rank in ranks]
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(self._ranks.pid(rank), signal.SIGUSR1)  # type: ignore[arg-type]
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and not all(self._stacks(rank) for rank in ranks):
            time.sleep(0.05)
        reports = []
        for rank in ranks:
            stacks = self._stacks(rank) or "(none written: the rank had not got that far)\n"
            detail = f"{why}; its stacks:\n{stacks}" if why else f"its stacks:\n{stacks}"
            reports.append(_Report(rank, outcome, detail))
        return reports

    def _stacks(self, rank: int) -> str:
        try:
            with open(_stack_path(self._ranks.directory, rank)) as stacks:
                return stacks.read()
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        """Stop ranks that never reported, let the others exit, and remove the files."""
        self._ranks.close(_GRACE_S, finishing=self._reported)


def _failure_message(reports: list[_Report], world_size: int, traces: dict[int, RankTrace]) -> str:
    """Every rank that did not pass, the first to stop first: it is usually the cause.

    Collectives that cannot match, or that some ranks issued and others did not, come
    before the ranks: they name the culprit of a hang. See [Note: collective trace].
    """
    failed = [report for report in reports if report.outcome is not _Outcome.PASSED]
    sections = [f"{len(failed)} of {world_size} ranks did not pass (first to stop first)"]
    mismatch = find_mismatch(traces)
    findings = ([mismatch] if mismatch else []) + find_unmatched(traces)
    if findings:
        sections.append("\n".join(["collectives:", *(f"  {finding}" for finding in findings)]))
    for report in failed:
        trace = traces.get(report.rank)
        last = f"its last collective: {trace.last.describe()}" if trace else "no collective issued"
        header = f"---- rank {report.rank} {report.outcome.value} ----"
        sections.append(f"{header}\n{last}\n{report.detail}")
    return "\n\n".join(section.rstrip() for section in sections)


class FSDPTest(DistributedTestMixin, unittest.TestCase):
    """A test case whose methods run on ``world_size`` ranks, one process each.

    See [Note: how a test method reaches the ranks]. Class attributes to override:
    ``timeout_s`` (per test), ``fake_pg`` and ``fake_rank`` (run in the pytest process as
    that rank of a fake group of ``world_size``; ``@with_fake_pg`` does it for one method).
    """

    timeout_s: ClassVar[float] = 120.0
    fake_pg: ClassVar[bool] = False
    fake_rank: ClassVar[int] = 0

    def __init__(self, methodName: str = "runTest") -> None:
        super().__init__(methodName)
        method = getattr(self, methodName, None)
        if _running_in_rank() or method is None:
            return
        if getattr(method, "_reffsdp_fake_pg", self.fake_pg):
            self.setUp = self._in_fake_group(self.setUp)  # type: ignore[method-assign]
            return

        @functools.wraps(method)  # keeps skip decorators visible to unittest and pytest
        def launch() -> None:
            __tracebackhide__ = True  # pytest: the ranks' tracebacks are the story
            self._run_in_rank_processes()

        setattr(self, methodName, launch)
        self.setUp = self.tearDown = _do_nothing  # type: ignore[method-assign]

    def _callTestMethod(self, method: Callable[[], object]) -> None:
        # In a rank process, run the per-rank hooks around the test method, as the
        # threaded harness does.
        if not _running_in_rank():
            super()._callTestMethod(method)  # type: ignore[misc]
            return
        self.perThreadSetUp()
        try:
            super()._callTestMethod(method)  # type: ignore[misc]
        finally:
            self.perThreadTearDown()

    @contextlib.contextmanager
    def subTest(self, msg: Any = None, **params: Any) -> Iterator[None]:
        """Like ``TestCase.subTest``, but a failure ends the test; see [Note: outcomes]."""
        try:
            yield
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11+
                label = params if msg is None else f"{msg!r} {params}"
                error.add_note(f"in subTest {label}")
            raise

    def _in_fake_group(self, set_up: Callable[[], None]) -> Callable[[], None]:
        def set_up_in_fake_group() -> None:
            group = contextlib.ExitStack()
            group.enter_context(fake_process_group(self.world_size, self.fake_rank))
            self.addCleanup(group.close)  # after tearDown, even when setUp fails
            set_up()

        return set_up_in_fake_group

    def _run_in_rank_processes(self) -> None:
        __tracebackhide__ = True
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        device_type = self.device_type
        run = _TestRun(_TestAddress.of(self), device_type, self.timeout_s)
        if read_launched_env() is not None:  # [Note: a test module under torchrun]
            self._run_as_launched_rank(run)
            return
        if device_type == "cuda" and torch.cuda.device_count() < self.world_size:
            self.skipTest(
                f"needs {self.world_size} CUDA devices (one per rank), "
                f"found {torch.cuda.device_count()}"
            )
        ranks = _RankProcesses(run, self.world_size)
        try:
            reports = ranks.wait_for_reports(self.timeout_s)
            traces = ranks.traces()
        finally:
            ranks.close()
        first_abnormal = next((r for r in reports if r.outcome is not _Outcome.PASSED), None)
        if first_abnormal is None:
            return
        if first_abnormal.outcome is _Outcome.SKIPPED:
            raise unittest.SkipTest(first_abnormal.detail)
        self.fail(_failure_message(reports, self.world_size, traces))

    def _run_as_launched_rank(self, run: _TestRun) -> None:
        """This pytest process's rank runs the test; see [Note: a test module under
        torchrun]."""
        __tracebackhide__ = True
        launched = read_launched_env()
        assert launched is not None
        if launched.world_size != self.world_size:
            self.skipTest(
                f"needs {self.world_size} ranks, but {launched.launcher} launched "
                f"{launched.world_size}"
            )
        with join_ranks(_rank_main, launched_world(), (run,)) as rank:
            reports: list[_Report] = []
            try:
                reports.extend(report for _, report in rank.messages())
            except RankFailed as failure:  # this rank raised, or a peer failed
                reports.append(_Report(failure.rank, _Outcome.FAILED, failure.detail))
            traces = _joined_trace(rank)
        abnormal = next((r for r in reports if r.outcome is not _Outcome.PASSED), None)
        if abnormal is None:
            return
        if abnormal.outcome is _Outcome.SKIPPED:
            raise unittest.SkipTest(abnormal.detail)
        self.fail(_failure_message([abnormal], self.world_size, traces))


def _joined_trace(rank: JoinedRank) -> dict[int, RankTrace]:
    """What this joined rank's collectives were (its peers' traces are on their nodes)."""
    trace = read_trace(_trace_path(rank.directory, rank.world.rank), rank.world.rank)
    return {} if trace is None else {trace.rank: trace}


def _do_nothing() -> None:
    """Stands in for ``setUp``/``tearDown`` in the pytest process; the ranks run the real ones."""
