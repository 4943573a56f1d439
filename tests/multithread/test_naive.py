"""``reffsdp.naive.NaiveFSDP``, the reader's first page, trains exactly like DDP.

On 2 and 4 threaded ranks: parity with DDP (losses, gradients, parameters, one all-gather
and one reduce-scatter per parameter per forward and backward), tied weights reduced once,
two backwards before a step leaving the sum, the module docstring's worked example with its
own numbers, and a planted wrong divide factor caught by the parity check.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from reffsdp.core.comms import Collective, intercept
from reffsdp.core.compat import reduce_scatter_single
from reffsdp.naive import NaiveFSDP
from reffsdp.testing.expected_comms import StepShape, expected_per_step, naive_units
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLPStack, TiedMLPStack, init_deterministic
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity
from reffsdp.testing.patching import count_all_gathers

pytestmark = pytest.mark.multithread

DIM = 5  # 15- and 20-row layers: flat sizes that need padding on 2 and 4 ranks
make_inputs = random_inputs(3, DIM)


class NaiveChecks:
    """Run on each world size below."""

    def _check_parity(self, model, num_microbatches=1):
        """``model`` under ``NaiveFSDP`` against DDP, with its expected collectives."""
        shape = StepShape(self.world_size, num_microbatches=num_microbatches)
        counts, _ = expected_per_step(naive_units(model, self.world_size), shape)
        ref_model = copy.deepcopy(model)
        naive = NaiveFSDP(model)
        check_train_parity(
            self,
            ref_model,
            naive,
            make_inputs,
            num_steps=3,
            num_microbatches=num_microbatches,
            expected_counts=counts,
        )
        return naive

    def test_matches_ddp_and_its_parameters_are_the_slices(self):
        naive = self._check_parity(init_deterministic(MLPStack(DIM)))
        in_proj = naive.sharded["0.in_proj.weight"]  # 15 x 5 = 75 elements, padded
        expected = -(-75 // self.world_size)
        self.assertEqual(in_proj.shard.shape, (expected,))
        self.assertEqual(in_proj.shape, (15, 5))
        self.assertIs(naive.module[0].in_proj.weight, in_proj.shard)
        shards = [id(p.shard) for p in naive.sharded.values()]
        self.assertEqual([id(p) for p in naive.parameters()], shards)

    def test_tied_weights_are_sharded_once_and_reduced_once(self):
        model = init_deterministic(TiedMLPStack(DIM))
        naive = self._check_parity(model)  # expected counts: the tied weight once
        tied = naive.sharded["proj.weight"]
        self.assertEqual(len(tied.places), 2)
        self.assertIs(model.head.weight, model.proj.weight)
        self.assertIs(model.head.weight, tied.shard)
        self.assertNotIn("head.weight", naive.sharded)

    def test_two_backwards_without_a_step_give_the_sum(self):
        self._check_parity(init_deterministic(MLPStack(DIM)), num_microbatches=2)
        naive = NaiveFSDP(init_deterministic(MLPStack(DIM)))
        inputs = [make_inputs(i, self.rank) for i in range(2)]
        alone = []
        for x in inputs:
            naive(x).sum().backward()
            alone.append([p.grad.clone() for p in naive.parameters()])
            naive.zero_grad()
        for x in inputs:
            naive(x).sum().backward()
        for grad, first, second in zip((p.grad for p in naive.parameters()), *alone):
            torch.testing.assert_close(grad, first + second)

    def test_a_wrong_divide_factor_is_caught(self):
        def times_world_size(output, input, op=None, group=None, async_op=False):
            reduce_scatter_single()(output, input, op=op, group=group)
            output.mul_(dist.get_world_size(group))  # the divide then leaves the plain sum

        with intercept(Collective.REDUCE_SCATTER, times_world_size):
            with self.assertRaisesRegex(AssertionError, "step 0 after backward"):
                self._check_parity(init_deterministic(MLPStack(DIM)))


class TestNaiveFSDP(NaiveChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_the_worked_example_of_the_module_docstring(self):
        model = torch.nn.Linear(5, 1, bias=False)  # the weight: [a b c d e]
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[10.0, 11, 12, 13, 14]]))
        naive = NaiveFSDP(model)
        kept = {0: [10.0, 11, 12], 1: [13.0, 14, 0]}[self.rank]
        self.assertEqual(model.weight.tolist(), kept)
        # the input makes the gradient: [1 2 3 4 5] on rank 0, [3 4 5 6 7] on rank 1
        x = torch.arange(1.0, 6.0) + 2 * self.rank
        with count_all_gathers() as gathers:
            naive(x).sum().backward()
        self.assertEqual(gathers, [1])
        reduced = {0: [2.0, 3, 4], 1: [5.0, 6, 0]}[self.rank]
        self.assertEqual(model.weight.grad.tolist(), reduced)


class TestNaiveFSDPOnFourRanks(NaiveChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4
