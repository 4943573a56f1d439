"""FSDPTest cases that ``tests/multiprocess/test_launched_tools.py`` runs under torchrun with
two workers (not collected on their own: the file name does not start with ``test_``).

Each worker is a pytest process and one rank of the launched world: the cases check that
the test body runs in that process, as its launched rank, on a world of the launched size.
The last class fails on rank 1 only, so the run also shows a failure ending both ranks.
"""

from __future__ import annotations

import multiprocessing
import os

import torch
import torch.distributed as dist

from reffsdp import fully_shard
from reffsdp.testing.multiprocess import FSDPTest


class TestOnTheLaunchedRanks(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_the_body_runs_in_the_launched_process_as_its_rank(self) -> None:
        assert multiprocessing.parent_process() is None  # nothing spawned this process
        assert dist.get_rank() == int(os.environ["RANK"])
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total)
        assert total.item() == 3.0

    def test_fully_shard_trains_alike_on_every_rank(self) -> None:
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(4, 4))
        model(torch.ones(2, 4)).sum().backward()
        grad = model.weight.grad.full_tensor()
        every = [torch.empty_like(grad) for _ in range(2)]
        dist.all_gather(every, grad)
        torch.testing.assert_close(every[0], every[1])


class TestOnFourRanks(FSDPTest):
    @property
    def world_size(self) -> int:
        return 4

    def test_is_skipped_on_two(self) -> None:
        raise AssertionError("a 4-rank test ran on a world of 2")


class TestFailingOnRankOne(FSDPTest):
    timeout_s = 30.0

    def test_rank_one_fails_before_a_collective(self) -> None:
        if self.rank == 1:
            raise ValueError("planted failure on rank 1")
        dist.all_reduce(torch.ones(1))
