"""``FSDPTestMultiThread``: every test runs on every rank, and failures come back whole.

The failure, skip and timeout cases define small test classes inside the test functions
(so pytest does not collect them) and run them with ``unittest``'s own runner.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import unittest

import pytest
import torch
import torch.distributed as dist
from torch import nn

from reffsdp.core.compat import all_gather_single
from reffsdp.testing.multithread import FSDPTestMultiThread, run_threaded

pytestmark = pytest.mark.multithread


def _run_case(case_class: type[unittest.TestCase]) -> unittest.TestResult:
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case_class).run(result)
    return result


def _gather_objects(value: object) -> list[object]:
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class TestHarnessInterface(FSDPTestMultiThread):
    def test_every_rank_runs_with_its_own_rank(self):
        self.assertEqual(self.world_size, 2)
        self.assertEqual(dist.get_world_size(), self.world_size)
        self.assertEqual(_gather_objects(self.rank), [0, 1])
        self.assertEqual(threading.current_thread().name, f"rank{self.rank}")
        self.assertEqual(self.device, torch.device("cpu"))
        self.assertEqual(dist.get_backend(), "threaded")

    def test_each_rank_has_its_own_instance(self):
        self.marker = self.rank
        dist.barrier()
        self.assertEqual(self.marker, self.rank)
        self.assertEqual(len(set(_gather_objects(id(self)))), self.world_size)

    def test_run_subtests_covers_the_product_on_every_rank(self):
        calls: list[tuple[int, str]] = []
        self.run_subtests({"a": [1, 2], "b": ["x", "y"]}, lambda a, b: calls.append((a, b)))
        self.assertEqual(calls, [(1, "x"), (1, "y"), (2, "x"), (2, "y")])

    def test_sync_module_states_makes_ranks_agree(self):
        torch.manual_seed(self.rank)  # the shared RNG gives ranks different weights anyway
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        model[1].running_mean.fill_(float(self.rank))
        self.sync_module_states(model)
        flat = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()])
        everyone = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype)
        all_gather_single()(everyone, flat)
        for other in everyone.chunk(self.world_size):
            self.assertTrue(torch.equal(other, flat))
        self.assertTrue(torch.equal(model[1].running_mean, torch.zeros(4)))


class TestWorldSizeOverride(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_four_ranks(self):
        self.assertEqual(_gather_objects(self.rank), [0, 1, 2, 3])


class TestPerThreadHooks(FSDPTestMultiThread):
    def perThreadSetUp(self) -> None:
        self.prepared_on = dist.get_rank()

    def test_setup_ran_on_this_rank(self):
        self.assertEqual(self.prepared_on, self.rank)


@pytest.mark.timeout(30)
def test_failing_rank_fails_the_test_with_its_rank_and_traceback():
    class Failing(FSDPTestMultiThread):
        def test_rank_1_fails(self):
            dist.barrier()
            self.assertEqual(self.rank, 0, "only rank 0 passes")
            dist.barrier()  # rank 0 waits here; it must be released, not time out

    start = time.monotonic()
    result = _run_case(Failing)
    assert result.testsRun == 1 and len(result.errors) == 1, result.errors
    report = result.errors[0][1]
    assert "rank 1 failed" in report and "rank 0 failed" not in report
    assert "test_rank_1_fails" in report and "only rank 0 passes" in report
    assert "ranks [0] stopped with CollectiveAborted" in report
    assert time.monotonic() - start < 10


@pytest.mark.timeout(30)
def test_skip_on_a_rank_skips_the_test():
    class Skipping(FSDPTestMultiThread):
        def test_everyone_skips(self):
            self.skipTest("not on this machine")

        def test_one_rank_skips(self):
            if self.rank == 1:
                self.skipTest("rank 1 cannot run this")
            dist.barrier()  # released by the skip, like any failure on a peer

    result = _run_case(Skipping)
    assert not result.errors and not result.failures, result.errors
    reasons = sorted(reason for _, reason in result.skipped)
    assert reasons == ["rank 0: not on this machine", "rank 1: rank 1 cannot run this"]


@pytest.mark.timeout(30)
def test_timeout_fails_instead_of_hanging():
    class Stuck(FSDPTestMultiThread):
        timeout_s = 1.0

        def test_rank_1_never_arrives(self):
            if self.rank == 1:
                threading.Event().wait(2.0)  # past the deadline, then leave
            else:
                dist.barrier()

    start = time.monotonic()
    result = _run_case(Stuck)
    assert len(result.errors) == 1
    assert "rank 1 did not finish within 1s" in result.errors[0][1]
    assert time.monotonic() - start < 10


def test_c10d_state_is_clean_after_a_failed_test():
    world, hook = dist.distributed_c10d._world, sys.excepthook

    class Failing(FSDPTestMultiThread):
        def test_fails(self):
            dist.new_group([0])
            raise RuntimeError("leave groups behind")

    assert len(_run_case(Failing).errors) == 1
    assert dist.distributed_c10d._world is world and sys.excepthook is hook
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_rank_spinning_past_the_deadline_is_ended():
    class Spinning(FSDPTestMultiThread):
        timeout_s = 1.0

        def test_rank_1_spins(self):
            if self.rank == 1:
                while True:  # pure Python: ended by an exception raised in its thread
                    pass
            dist.barrier()

    result = _run_case(Spinning)
    assert len(result.errors) == 1
    assert "rank 1 did not finish within 1s" in result.errors[0][1]
    assert "could not be stopped" not in result.errors[0][1]
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("rank")]


@pytest.mark.timeout(60)
def test_a_rank_blocked_outside_python_is_reported_and_ends_once_it_returns():
    release = threading.Event()

    class Blocked(FSDPTestMultiThread):
        timeout_s = 1.0

        def test_rank_1_blocks(self):
            if self.rank == 1:
                release.wait()  # a lock wait in C, which nothing can interrupt

    result = _run_case(Blocked)
    assert len(result.errors) == 1
    assert "rank 1 could not be stopped" in result.errors[0][1]
    (late,) = [thread for thread in threading.enumerate() if thread.name == "rank1"]
    # The next test runs clean beside it.
    assert _run_case(TestHarnessInterface).wasSuccessful()
    release.set()  # back in Python, the rank raises the exception left pending for it
    late.join(10)
    assert not late.is_alive()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_rank_threads_are_gone_from_the_os_when_the_run_returns():
    """[Note: a rank thread ends twice]: nothing of a run's threads outlives it."""
    native_ids: list[int] = []

    def rank_main(rank: int) -> None:
        native_ids.append(threading.get_native_id())
        x = torch.randn(8, 8, requires_grad=True)
        (x @ x).sum().backward()  # torch 2.12 leaves an object in autograd's thread-locals

    for _ in range(10):
        run_threaded(rank_main, 4)
        assert [tid for tid in native_ids if os.path.exists(f"/proc/self/task/{tid}")] == []


@pytest.mark.timeout(120)
def test_a_process_that_ends_right_after_threaded_runs_exits_cleanly(tmp_path):
    """Rank threads ending during interpreter shutdown aborted the process on torch 2.12
    (exit status 134) in about one run of seven."""
    script = tmp_path / "runs.py"
    script.write_text(
        "import torch\n"
        "from reffsdp.testing.multithread import run_threaded\n"
        "def rank_main(rank):\n"
        "    x = torch.randn(50, 50, requires_grad=True)\n"
        "    (x @ x).sum().backward()\n"
        "for _ in range(5):\n"
        "    run_threaded(rank_main, 4)\n"
    )
    for _ in range(5):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.timeout(60)
def test_a_rank_whose_start_an_interrupt_cut_short_is_stopped_too(monkeypatch):
    """[Note: an interrupted run]: Ctrl-C can end ``Thread.start`` before the new thread
    has begun; that thread begins anyway and must not outlive the run (one left running
    into interpreter shutdown aborted the parity command in about one Ctrl-C of ten)."""
    real_start = threading.Thread.start
    begun = threading.Event()

    def start(thread: threading.Thread) -> None:
        if thread.name != "rank1":
            real_start(thread)
            return

        def late_start() -> None:
            time.sleep(0.2)
            real_start(thread)
            begun.set()

        threading.Thread(target=late_start, name="late-start").start()
        raise KeyboardInterrupt  # as if Ctrl-C came while start() waited

    def rank_main(rank: int) -> None:
        if rank == 1:
            time.sleep(30)  # ends with the run (see [Note: stopping a rank thread])

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        run_threaded(rank_main, 2)
    assert begun.wait(10)  # set once the late start() returns, maybe after the run ended
    assert [t.name for t in threading.enumerate() if t.name.startswith("rank")] == []


def test_each_rank_thread_frees_its_dtensor_cache_before_it_ends(monkeypatch):
    """DTensor's per-thread sharding cache, freed by torch when a thread ends under a C++
    mutex that two ending threads can deadlock on, is freed by each rank thread itself, one
    at a time (see [Note: a rank thread's DTensor cache] in reffsdp.testing.thread_world)."""
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    from reffsdp.testing import multithread, torch_private

    held_before_release, held_after_release = {}, {}
    release = multithread.release_rank_thread

    def observed_release() -> None:
        rank = dist.get_rank() if dist.is_initialized() else threading.current_thread().name
        held_before_release[rank] = torch_private.dtensor_thread_cache_held()
        release()
        held_after_release[rank] = torch_private.dtensor_thread_cache_held()

    monkeypatch.setattr(multithread, "release_rank_thread", observed_release)

    def rank_main(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        tensor = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
        (tensor + tensor).sum()  # through DTensor's dispatch, which fills this thread's cache
        assert torch_private.dtensor_thread_cache_held()

    run_threaded(rank_main, 2)
    assert list(held_before_release.values()) == [True, True], held_before_release
    assert list(held_after_release.values()) == [False, False], held_after_release
