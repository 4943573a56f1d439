"""A fault planted on one rank fails the test, names the rank, and leaves nothing behind.

The test bodies are written once, in ``_Faults``, and run on both harnesses by switching
the base class: ``_ProcessFaults`` (``FSDPTest``, a process per rank over gloo) and
``_ThreadFaults`` (``FSDPTestMultiThread``). Pytest does not collect those classes; each
check below runs one of their tests with unittest, reads the failure, then runs a passing
test on the same harness to show that nothing of the fault is left.

The last checks end a pytest process running a multi-process test, as a user or a CI job
would, and look for processes it leaves behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest

import pytest
import torch
import torch.distributed as dist
from torch import nn

from reffsdp import fully_shard
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.multithread import FSDPTestMultiThread
from tests.cli_signals import ctrl_c_as_in_a_terminal

_HANG_TIMEOUT_S = 4.0


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("planted failure in backward")


def _raise_in_forward(module: nn.Module, args: tuple) -> None:
    raise RuntimeError("planted failure in forward")


class _Faults:
    """Each test plants one fault on rank 1; rank 0 does its part correctly."""

    __test__ = False

    @property
    def timeout_s(self) -> float:  # type: ignore[override]
        # A hang fails at the timeout; the other faults must fail long before it.
        return _HANG_TIMEOUT_S if self._testMethodName == "test_sleep_forever" else 60.0

    def _sharded_model(self) -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        fully_shard(model[0])
        fully_shard(model[2])
        return fully_shard(model)

    def test_passes(self) -> None:
        model = self._sharded_model()
        model(torch.ones(2, 4)).sum().backward()

    def test_raise_in_forward(self) -> None:
        model = self._sharded_model()
        if self.rank == 1:
            model[2].register_forward_pre_hook(_raise_in_forward)
        model(torch.ones(2, 4)).sum().backward()  # rank 0 waits in an all-gather

    def test_raise_in_backward(self) -> None:
        model = self._sharded_model()
        out = model(torch.ones(2, 4))
        if self.rank == 1:
            out = _RaiseInBackward.apply(out)
        out.sum().backward()  # rank 0 waits in a reduce-scatter

    def test_rank_exits(self) -> None:
        dist.barrier()
        if self.rank == 1:
            sys.exit(3)
        dist.barrier()

    def test_skipped_collective(self) -> None:
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        if self.rank == 0:
            dist.all_reduce(tensor)  # collective #1, which rank 1 skips

    def test_mismatched_collective(self) -> None:
        tensor = torch.ones(2)
        dist.barrier()
        if self.rank == 0:
            dist.all_reduce(tensor)  # collective #1 is an all-reduce on rank 0 ...
        else:
            dist.broadcast(tensor, src=0)  # ... and a broadcast on rank 1

    def test_sleep_forever(self) -> None:
        dist.barrier()
        if self.rank == 1:
            time.sleep(3600)
        dist.barrier()  # rank 0 waits here


class _ProcessFaults(_Faults, FSDPTest):
    device_type = "cpu"  # the harness itself is under test, on any machine


class _ThreadFaults(_Faults, FSDPTestMultiThread):
    pass


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(_ProcessFaults, marks=pytest.mark.multiprocess, id="processes"),
        pytest.param(_ThreadFaults, marks=pytest.mark.multithread, id="threads"),
    ],
)
def harness(request: pytest.FixtureRequest) -> type[unittest.TestCase]:
    _assert_passes(request.param)  # which also starts the fork server, once
    return request.param


def _failure(harness: type[unittest.TestCase], name: str) -> str:
    """Run ``harness``'s test ``name``, which must fail well before pytest's timeout."""
    start = time.monotonic()
    result = unittest.TestResult()
    harness(name).run(result)
    elapsed = time.monotonic() - start
    problems = result.failures + result.errors
    assert len(problems) == 1, (result.failures, result.errors, result.skipped)
    assert elapsed < _HANG_TIMEOUT_S + 20, f"{name} took {elapsed:.1f} s to fail"
    _assert_nothing_left(harness)
    return problems[0][1]


def _assert_nothing_left(harness: type[unittest.TestCase]) -> None:
    """No rank thread or rank process outlived the test, and the next test passes."""
    assert not [thread.name for thread in threading.enumerate() if thread.name.startswith("rank")]
    assert not dist.is_initialized()
    if sys.platform == "linux":
        assert not _rank_processes(), "rank processes outlived their test"
    _assert_passes(harness)


def _assert_passes(harness: type[unittest.TestCase]) -> None:
    result = unittest.TestResult()
    harness("test_passes").run(result)
    assert result.wasSuccessful() and result.testsRun == 1, result.errors + result.failures


def _rank_processes() -> list[int]:
    """Live grandchildren of this process: rank processes, children of the fork server."""
    parents = _live_processes()
    children = {pid for pid, parent in parents.items() if parent == os.getpid()}
    return [pid for pid, parent in parents.items() if parent in children]


def _live_processes() -> dict[int, int]:
    """Every live (not zombie) process's parent, by process id, from ``/proc``."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        if state != "Z":
            parents[int(entry)] = int(parent)
    return parents


def _first_failed_rank(message: str) -> int:
    """Both harnesses list the ranks that failed first, the first to fail first."""
    found = re.search(r"rank (\d+) failed", message)
    assert found, message
    return int(found.group(1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "test_name, error",
    [
        ("test_raise_in_forward", "RuntimeError: planted failure in forward"),
        ("test_raise_in_backward", "RuntimeError: planted failure in backward"),
        ("test_rank_exits", "SystemExit: 3"),
    ],
)
def test_rank_1_fails(harness: type[unittest.TestCase], test_name: str, error: str) -> None:
    message = _failure(harness, test_name)
    assert _first_failed_rank(message) == 1
    assert error in message


@pytest.mark.timeout(60)
def test_skipped_collective(harness: type[unittest.TestCase]) -> None:
    # Names the collective rank 0 is left in (all-reduce #1) and rank 1 as the culprit.
    message = _failure(harness, "test_skipped_collective")
    if harness is _ProcessFaults:  # stopped as soon as rank 1 reached the harness's barrier
        assert "rank 0 was stopped: the ranks' collectives cannot match" in message
        expected = r"collective #1 on group '0' .* rank 0 issued allreduce, rank 1 issued barrier"
    else:
        expected = r"all_reduce.* on rank 0 \(collective #1 on group '0'.*ranks \[1\] destroyed"
    assert re.search(expected, message), message


@pytest.mark.timeout(60)
def test_mismatched_collective(harness: type[unittest.TestCase]) -> None:
    message = _failure(harness, "test_mismatched_collective")
    if harness is _ProcessFaults:  # stopped at once, not at the timeout
        assert "rank 0 was stopped: the ranks' collectives cannot match" in message
        expected = r"collective #1 on group '0' .* rank 0 issued allreduce, rank 1 issued broadcast"
    else:
        expected = r"collective #1 on group '0'.*\n.*rank 0: all_reduce.*\n.*rank 1: broadcast"
    assert re.search(expected, message), message


@pytest.mark.timeout(60)
def test_sleep_forever(harness: type[unittest.TestCase]) -> None:
    # Fails at the timeout, with rank 1's stack, which shows where it hangs.
    message = _failure(harness, "test_sleep_forever")
    if harness is _ProcessFaults:
        assert re.search(r"rank 1 timed out ----\n.*\n.*its stacks:(\n.*)*sleep_forever", message)
        culprit = "barrier #1 on group '0' (global ranks [0, 1]) was issued by rank 0 but not by "
        assert culprit + "rank 1 (its last there: #0)" in message
    else:
        late = f"rank 1 did not finish within {_HANG_TIMEOUT_S:g}s; its stack then:"
        assert re.search(re.escape(late) + r"(\n.*)*time\.sleep\(3600\)", message), message
        # Rank 0's collective, aborted by the harness or timed out by the group.
        assert "barrier() on rank 0 (collective #1 on group '0', global ranks [0, 1])" in message


_HANGING_TEST = """
import os
import time

import torch.distributed as dist

from reffsdp.testing import FSDPTest


class TestHangs(FSDPTest):
    device_type = "cpu"  # the harness itself is under test, on any machine
    timeout_s = 600.0

    def test_hangs(self):
        ready = os.path.join(os.environ["RANKS_READY_DIR"], f"rank{self.rank}")
        with open(ready + ".part", "w") as file:
            file.write(str(os.getpid()))
        os.rename(ready + ".part", ready)
        if self.rank == 0:
            dist.barrier()  # waits for rank 1, ...
        else:
            time.sleep(600)  # ... which never comes
"""


class _HangingPytest:
    """A pytest process, run on ``_HANGING_TEST``, and the processes it starts."""

    def __init__(self, directory) -> None:
        directory.mkdir()
        (directory / "test_hangs.py").write_text(_HANGING_TEST)
        self._directory = directory
        self._output = open(directory / "output.txt", "w")  # noqa: SIM115 - closed in kill()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_hangs.py"],
            cwd=directory,
            env=dict(os.environ, RANKS_READY_DIR=str(directory)),
            stdout=self._output,
            stderr=subprocess.STDOUT,
            preexec_fn=ctrl_c_as_in_a_terminal,
        )
        self.ranks: set[int] = set()
        self.started: set[int] = set()  # the ranks, the fork server and its resource tracker

    def wait_for_ranks(self, deadline: float) -> None:
        """Wait until both ranks run the test; then note every process pytest started."""
        ready = [self._directory / f"rank{rank}" for rank in range(2)]
        while not all(path.exists() for path in ready):
            assert self.process.poll() is None, (self._directory / "output.txt").read_text()
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        self.ranks = {int(path.read_text()) for path in ready}
        self.started = _descendants(self.process.pid)
        assert self.ranks < self.started, (self.ranks, self.started)

    def wait_for_exit(self, pids: set[int], deadline: float) -> set[int]:
        """Those of ``pids`` still running at ``deadline`` (by ``time.monotonic``)."""
        while (left := pids & set(_live_processes())) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def kill(self) -> None:
        """Kill pytest and whatever it left, if the test failed; close the output."""
        self.process.kill()
        self.process.wait()
        for pid in self.started & set(_live_processes()):
            os.kill(pid, signal.SIGKILL)
        self._output.close()


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="finds processes through /proc")
@pytest.mark.timeout(180)
def test_nothing_outlives_an_ended_pytest(tmp_path) -> None:
    # How long the rank processes of a pytest ended by each signal may live on. The three
    # runs go side by side: each spends seconds importing torch.
    limits_s = {signal.SIGTERM: 5.0, signal.SIGINT: 5.0, signal.SIGKILL: 10.0}
    runs = {signum: _HangingPytest(tmp_path / signum.name) for signum in limits_s}
    try:
        deadline = time.monotonic() + 120
        for run in runs.values():
            run.wait_for_ranks(deadline)
        sent = time.monotonic()
        for signum, run in runs.items():
            run.process.send_signal(signum)
        for signum, run in runs.items():
            left = run.wait_for_exit(run.ranks, sent + limits_s[signum])
            assert not left, f"after {signum.name}, ranks {sorted(left)} live on"
        for signum, run in runs.items():
            # Pytest, the fork server and its resource tracker end too, if less promptly:
            # an interpreter with torch loaded can take seconds to shut down on a busy machine.
            run.process.wait(timeout=30)
            left = run.wait_for_exit(run.started, time.monotonic() + 30)
            assert not left, f"after {signum.name}, {sorted(left)} of {sorted(run.started)} live on"
    finally:
        for run in runs.values():
            run.kill()


def _descendants(pid: int) -> set[int]:
    parents = _live_processes()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found
