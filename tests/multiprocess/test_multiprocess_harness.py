"""The multi-process harness: ranks, failures, skips, timeouts and subtests.

How a rank's failure, skip or hang reaches the report is checked by running small inner
test cases (``_Failing``, ``_Hanging``) programmatically and reading their unittest result;
those classes set ``__test__ = False`` so pytest does not collect them itself.
"""

import os
import time
import unittest

import pytest
import torch
import torch.distributed as dist

from reffsdp.testing import common
from reffsdp.testing.collective_trace import (
    CollectiveRecorder,
    Issued,
    RankTrace,
    find_mismatch,
    find_unmatched,
    read_trace,
)
from reffsdp.testing.multiprocess import FSDPTest, with_fake_pg

pytestmark = pytest.mark.multiprocess

_IMPORTED_BY = os.getpid()


class TestRanks(FSDPTest):
    @property
    def world_size(self) -> int:
        return 3

    def setUp(self) -> None:
        super().setUp()
        self.set_up_on = (dist.get_rank(), os.getpid())

    def test_rank_world_size_device_and_subtests(self) -> None:
        # setUp ran in this rank's own process, with the group already there.
        self.assertEqual(self.set_up_on, (self.rank, os.getpid()))
        self.assertEqual(dist.get_world_size(), 3)
        ranks_and_pids = [None] * 3
        dist.all_gather_object(ranks_and_pids, (self.rank, os.getpid()))
        self.assertEqual([rank for rank, _ in ranks_and_pids], [0, 1, 2])
        self.assertEqual(len({pid for _, pid in ranks_and_pids}), 3)
        self.assertEqual(self.device.type, common.device_type_under_test())
        if self.device.type == "cuda":
            self.assertEqual(self.device.index, self.rank)

        seen = []
        self.run_subtests({"a": [1, 2], "b": ["x", "y"]}, lambda a, b: seen.append((a, b)))
        self.assertEqual(seen, [(1, "x"), (1, "y"), (2, "x"), (2, "y")])

    @with_fake_pg
    def test_fake_pg_method(self) -> None:
        self.assertEqual(os.getpid(), _IMPORTED_BY)  # the pytest process: no rank processes
        self.assertEqual((self.rank, dist.get_world_size()), (0, 3))
        self.assertEqual(dist.get_backend(), "fake")


class _Failing(FSDPTest):
    device_type = "cpu"  # the harness itself is under test, on any machine
    __test__ = False

    def test_rank1_raises_in_subtest(self) -> None:
        def check(step: int) -> None:
            if self.rank == 1 and step == 2:
                raise ValueError("planted failure on rank 1")

        # Rank 0 waits in run_subtests' barrier for rank 1, which never comes.
        self.run_subtests({"step": [1, 2, 3]}, check)

    def test_rank1_dies(self) -> None:
        if self.rank == 1:
            os._exit(3)

    def test_rank0_skips(self) -> None:
        if self.rank == 0:
            self.skipTest("planted skip on rank 0")
        dist.barrier()  # rank 1 waits for rank 0, which never comes

    def test_every_rank_passes(self) -> None:
        tensor = torch.ones(2) * (self.rank + 1)
        dist.all_reduce(tensor)
        self.assertEqual(tensor.tolist(), [3.0, 3.0])


class _Hanging(FSDPTest):
    device_type = "cpu"  # the harness itself is under test, on any machine
    __test__ = False
    timeout_s = 4.0

    def test_rank1_hangs(self) -> None:
        if self.rank == 1:
            time.sleep(60)


def _run(case: unittest.TestCase) -> unittest.TestResult:
    result = unittest.TestResult()
    case.run(result)
    return result


def test_failing_rank_reports_its_rank_and_traceback() -> None:
    result = _run(_Failing("test_rank1_raises_in_subtest"))
    assert len(result.failures) == 1 and not result.errors
    message = result.failures[0][1]
    assert "2 of 2 ranks did not pass" in message
    # Rank 1 stopped first, so it is listed first, with its traceback and subtest.
    rank1 = message.index("---- rank 1 failed ----")
    assert rank1 < message.index("---- rank 0 ")
    assert 'raise ValueError("planted failure on rank 1")' in message
    assert "ValueError: planted failure on rank 1" in message
    assert "in subTest" in message and "{'step': 2}" in message
    # Rank 0 waits in the barrier run_subtests issues after step 2; rank 1 never came.
    assert (
        "barrier #1 on group '0' (global ranks [0, 1]) was issued by rank 0 but not by rank 1 "
        "(its last there: #0)" in message
    )


def test_rank_that_dies_is_reported() -> None:
    result = _run(_Failing("test_rank1_dies"))
    message = result.failures[0][1]
    assert "---- rank 1 exited without reporting ----" in message
    assert "its exit code was 3" in message


def test_skip_on_one_rank_skips_the_test() -> None:
    result = _run(_Failing("test_rank0_skips"))
    assert not result.failures and not result.errors
    assert [reason for _, reason in result.skipped] == ["planted skip on rank 0"]


def test_passing_inner_case() -> None:
    result = _run(_Failing("test_every_rank_passes"))
    assert result.wasSuccessful() and result.testsRun == 1


def test_hung_rank_times_out_with_its_stack() -> None:
    start = time.monotonic()
    result = _run(_Hanging("test_rank1_hangs"))
    assert time.monotonic() - start < 30
    message = result.failures[0][1]
    assert "---- rank 1 timed out ----" in message
    assert "still running after 4.0 s" in message
    assert "in test_rank1_hangs" in message  # from the faulthandler stack dump


def test_class_defined_in_a_function_is_rejected() -> None:
    class Local(FSDPTest):
        device_type = "cpu"  # the harness itself is under test, on any machine

        def test_nothing(self) -> None:
            pass

    result = _run(Local("test_nothing"))
    assert "define FSDPTest classes at module level" in result.errors[0][1]


def _trace(rank: int, op: str, seq: int, *, closing: bool = False) -> RankTrace:
    return RankTrace(rank, Issued(op, "0", (0, 1), seq, closing), {"0": seq + 1})


def test_collective_trace_records_what_a_rank_issued(tmp_path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        recorder = CollectiveRecorder(str(tmp_path / "trace"))
        recorder.record(dist.group.WORLD, "allreduce")
        recorder.record(dist.group.WORLD, "broadcast")
        name = dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
    trace = read_trace(str(tmp_path / "trace"), 0)
    assert trace == RankTrace(0, Issued("broadcast", name, (0,), 1, False), {name: 2})
    assert read_trace(str(tmp_path / "missing"), 1) is None


def test_collective_trace_finds_mismatched_and_unmatched_collectives() -> None:
    # Ranks at different collectives of a group may just be on their way: no mismatch.
    assert find_mismatch({0: _trace(0, "allreduce", 2), 1: _trace(1, "allreduce", 1)}) is None
    assert find_mismatch({0: _trace(0, "allreduce", 2), 1: _trace(1, "barrier", 2)}) == (
        "collective #2 on group '0' (global ranks [0, 1]) differs: "
        "rank 0 issued allreduce, rank 1 issued barrier"
    )
    closing = find_mismatch({0: _trace(0, "barrier", 2), 1: _trace(1, "barrier", 2, closing=True)})
    assert closing is not None and "rank 1 issued barrier (the harness's barrier" in closing
    assert find_unmatched({0: _trace(0, "allreduce", 2), 1: _trace(1, "allreduce", 1)}) == [
        "allreduce #2 on group '0' (global ranks [0, 1]) was issued by rank 0 "
        "but not by rank 1 (its last there: #1)"
    ]
    assert find_unmatched({0: _trace(0, "allreduce", 0)}) == [
        "allreduce #0 on group '0' (global ranks [0, 1]) was issued by rank 0 "
        "but not by rank 1 (none there)"
    ]
