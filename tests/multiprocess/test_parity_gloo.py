"""The parity checkers over real gloo processes: right answers pass, planted bugs fail.

The threaded twin (``tests/multithread/test_parity_checks.py``) covers every planted bug;
this file repeats the main ones where collectives, DDP and the checkers' verdict all-reduce
run on a real backend, one process per rank.
"""

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from reffsdp.testing.models import MLP, init_deterministic
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.parity import (
    check_sharded_parity,
    check_train_parity,
)

pytestmark = pytest.mark.multiprocess


def _inputs(iteration: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * iteration + rank)
    return torch.randn(3, 5, generator=generator)


def _shard_with_grads(ref_model: nn.Module, mesh) -> nn.Module:
    """A copy of ``ref_model`` with ``Shard(0)`` DTensor parameters and gradients."""
    shard = lambda tensor: distribute_tensor(tensor, mesh, [Shard(0)], src_data_rank=None)
    sharded_model = copy.deepcopy(ref_model)
    for module in sharded_model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(shard(param.detach())))
    for ref_param, param in zip(ref_model.parameters(), sharded_model.parameters()):
        param.grad = shard(ref_param.grad)
    return sharded_model


class AveragingDataParallel(nn.Module):
    """Averages each grad over ranks once backward has built it, then calls ``grad_bug``.

    ``grad_bug(rank, grad)`` edits the averaged gradient in place to plant a bug.
    """

    def __init__(
        self, module: nn.Module, grad_bug: Callable[[int, torch.Tensor], None] | None = None
    ) -> None:
        super().__init__()
        self.module = module
        self.grad_bug = grad_bug
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._average_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    @torch.no_grad()
    def _average_grad(self, param: torch.Tensor) -> None:
        dist.all_reduce(param.grad)  # gloo has no ReduceOp.AVG, so SUM then divide
        param.grad.div_(dist.get_world_size())
        if self.grad_bug is not None:
            self.grad_bug(dist.get_rank(), param.grad)


class TestParityOverGloo(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def _train(self, grad_bug=None) -> list[float]:
        ref_model = init_deterministic(MLP(5))
        model = AveragingDataParallel(copy.deepcopy(ref_model), grad_bug)
        return check_train_parity(
            self, ref_model, model, _inputs, num_steps=2, prefixes_to_ignore=("module.",)
        )

    def test_averaging_data_parallel_matches_ddp(self):
        self.assertEqual(len(self._train()), 2)

    def test_catches_sum_instead_of_average(self):
        sum_not_average = lambda rank, grad: grad.mul_(dist.get_world_size())
        with self.assertRaisesRegex(AssertionError, "step 0 after backward: .*\n.*grad of"):
            self._train(sum_not_average)

    def test_catches_a_grad_scaled_on_one_rank(self):
        double_on_rank_1 = lambda rank, grad: grad.mul_(2) if rank == 1 else None
        expected = "rank 1: max abs diff" if self.rank == 1 else r"failed on rank\(s\) \[1\]"
        with self.assertRaisesRegex(AssertionError, expected):
            self._train(double_on_rank_1)

    def test_sharded_parity_catches_a_grad_shard_scaled_on_one_rank(self):
        ref_model = init_deterministic(MLP(5))
        ref_model(_inputs(0, self.rank)).sum().backward()
        sharded_model = _shard_with_grads(ref_model, init_device_mesh("cpu", (self.world_size,)))
        check_sharded_parity(self, ref_model, sharded_model)
        if self.rank == 0:
            sharded_model.out_proj.bias.grad.to_local().mul_(2)
        expected = "rank 0: max abs diff" if self.rank == 0 else r"failed on rank\(s\) \[0\]"
        with self.assertRaisesRegex(AssertionError, expected):
            check_sharded_parity(self, ref_model, sharded_model)
