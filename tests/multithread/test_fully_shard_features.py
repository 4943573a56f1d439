"""``fully_shard`` features that change which parameters a group holds, against DDP.

Shared and tied parameters (in one call and in a grouped ``fully_shard([a, b])`` call),
frozen and ignored parameters, and several forwards of one group before one backward.
The gradient knobs are in ``test_fully_shard_gradients.py``.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from reffsdp import fully_shard
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity
from reffsdp.testing.patching import count_all_gathers

pytestmark = pytest.mark.multithread


make_inputs = random_inputs(2, 8)


class TiedBlock(nn.Module):
    """``lin_b(relu(lin_a(x)))`` with ``lin_b.weight`` the same parameter as ``lin_a.weight``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_a = nn.Linear(dim, dim)
        self.lin_b = nn.Linear(dim, dim)
        self.lin_b.weight = self.lin_a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(F.relu(self.lin_a(x)))


class SharedEnds(nn.Module):
    """``first`` and ``last`` share their weight, with an independent ``middle`` between."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.first = nn.Linear(dim, dim)
        self.middle = MLP(dim)
        self.last = nn.Linear(dim, dim)
        self.last.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.middle(F.relu(self.first(x))))


class RepeatedBlock(nn.Module):
    """Calls ``block`` twice in one forward: two forwards of one group before one backward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = MLP(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)))


class TwoForwards(nn.Module):
    """Runs ``module`` on two inputs; the summed loss then backpropagates through both."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module(x1), self.module(x2)


class TestFullyShardParams(FSDPTestMultiThread):
    """Which parameters a group holds: shared, grouped, frozen, ignored, used twice."""

    @property
    def world_size(self) -> int:
        return 2

    def test_tied_params_in_one_call(self):
        ref_model, model = reference_and_model(nn.Sequential(TiedBlock(8), MLP(8)))
        shard_bottom_up(model, model)
        self.assertIs(model[0].lin_a.weight, model[0].lin_b.weight)
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)
        self.assertIs(model[0].lin_a.weight, model[0].lin_b.weight)

    def test_grouped_call_with_shared_param(self):
        ref_model, model = reference_and_model(SharedEnds(8))
        fully_shard(model.middle)
        fully_shard([model.first, model.last])
        fully_shard(model)
        self.assertIs(model.first.weight, model.last.weight)
        self.assertIsInstance(model.first.weight, DTensor)
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)

    def test_grouped_call_gathers_once_per_forward(self):
        # The group's post-forward runs when its last listed module finishes, so the shared
        # weight is gathered once for `first` and `last` together.
        _, model = reference_and_model(SharedEnds(8))
        fully_shard(model.middle)
        fully_shard([model.first, model.last])
        fully_shard(model)
        with count_all_gathers() as count, torch.no_grad():
            model(make_inputs(0, self.rank))
        self.assertEqual(count[0], 2)  # [first, last] and middle; the root has no params

    def test_frozen_params(self):
        self.run_subtests(
            {"frozen": [("0.in_proj.weight",), ("0.in_proj.weight", "1.in_proj", "1.out_proj")]},
            self._test_frozen_params,
        )

    def _test_frozen_params(self, frozen: tuple[str, ...]):
        model = MLPStack(8)
        for name, param in model.named_parameters():
            if name.startswith(frozen):
                param.requires_grad_(False)
        ref_model, model = reference_and_model(model)
        shard_bottom_up(model, model)
        for name, param in model.named_parameters():
            self.assertEqual(param.requires_grad, not name.startswith(frozen), name)
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)
        for name, param in model.named_parameters():
            if name.startswith(frozen):
                self.assertIsNone(param.grad, name)

    def test_ignored_params(self):
        model = nn.Sequential(MLP(8), MLP(8), nn.Linear(8, 8))
        ref_model, model = reference_and_model(model)
        ignored_names = ["0.in_proj.weight", "2.bias"]
        fully_shard(model[0], ignored_params={model[0].in_proj.weight})
        fully_shard(model[1])
        fully_shard(model, ignored_params={model[2].bias})
        for name, param in model.named_parameters():
            self.assertEqual(isinstance(param, DTensor), name not in ignored_names, name)
        # Ignored parameters keep their local gradients: the reference must not average them.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            ref_model, ignored_names
        )
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)
        # The ranks saw different data, so their unreduced gradients differ.
        grads = [torch.empty_like(model[0].in_proj.weight.grad) for _ in range(self.world_size)]
        dist.all_gather(grads, model[0].in_proj.weight.grad)
        self.assertFalse(torch.equal(grads[0], grads[1]))

    def test_same_block_twice_in_one_forward(self):
        self.run_subtests(
            {"reshard_after_forward": [True, False]}, self._test_same_block_twice_in_one_forward
        )

    def _test_same_block_twice_in_one_forward(self, reshard_after_forward: bool):
        ref_model, model = reference_and_model(RepeatedBlock(8))
        shard_bottom_up(model, [model.block], reshard_after_forward=reshard_after_forward)
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)

    def test_two_forwards_then_one_backward(self):
        ref_model, model = reference_and_model(MLPStack(8))
        shard_bottom_up(model, model)
        make = make_inputs
        check_train_parity(
            self,
            TwoForwards(ref_model),
            TwoForwards(model),
            lambda i, rank: (make(2 * i, rank), make(2 * i + 1, rank)),
            num_steps=3,
        )


class TestFullyShardParamsWorldSize4(TestFullyShardParams):
    @property
    def world_size(self) -> int:
        return 4
