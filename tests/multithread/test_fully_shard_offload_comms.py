"""CPU offload on a CPU mesh, user-supplied collectives and the reduce-scatter knobs.

* ``CPUOffloadPolicy`` with a CPU compute device has nothing to move: training must be
  identical to no offload, and nothing is pinned (pinning needs an accelerator).
* ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` hand the collective to a user
  object: it must be called once per unshard / reduction and give the same training.
* ``set_separate_reduce_scatter_group`` moves reduce-scatters to a second process group over
  the same ranks; ``set_reduce_scatter_max_input_buffers`` bounds in-flight reductions. Both
  are performance knobs: training must not change.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from reffsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from reffsdp.core import compat
from reffsdp.per_param.api import AllGather, ReduceScatter
from reffsdp.testing.build import fsdp_modules, reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLPBlocks
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity
from reffsdp.testing.patching import observe_all_gathers, observe_reduce_scatters

pytestmark = pytest.mark.multithread

DIM = 8
NUM_BLOCKS = 3


make_inputs = random_inputs(2, DIM)


class _CountingComm:
    """Counts allocations and calls; the collective itself is ``torch.distributed``'s."""

    def __init__(self) -> None:
        self.allocations = 0
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_CountingComm, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        all_gather = compat.all_gather_single()  # dist.all_gather_single on torch 2.13
        return all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(_CountingComm, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        reduce_scatter = compat.reduce_scatter_single()  # dist.reduce_scatter_single on 2.13
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class TestOffloadAndComms(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _ref_and_model(self, **fsdp_kwargs) -> tuple[nn.Module, MLPBlocks]:
        ref, model = reference_and_model(MLPBlocks(DIM, (3,) * NUM_BLOCKS))
        mesh = init_device_mesh("cpu", (self.world_size,))
        return ref, shard_bottom_up(model, model.layers, mesh=mesh, **fsdp_kwargs)

    # -- CPU offload --------------------------------------------------------------------

    def test_offload_policies_on_cpu_train_like_ddp(self):
        self.run_subtests(
            {
                "offload_policy": [
                    OffloadPolicy(),
                    CPUOffloadPolicy(pin_memory=False),
                    CPUOffloadPolicy(),  # pin_memory=True: nothing to pin for CPU compute
                ],
                "reshard_after_forward": [True, False],
            },
            self._check_offload,
        )

    def _check_offload(self, offload_policy, reshard_after_forward):
        ref, model = self._ref_and_model(
            offload_policy=offload_policy, reshard_after_forward=reshard_after_forward
        )
        check_train_parity(self, ref, model, make_inputs, num_steps=2)
        for name, param in model.named_parameters():
            local = param.to_local()
            self.assertEqual(local.device, torch.device("cpu"), name)
            self.assertFalse(local.is_pinned(), name)
            self.assertEqual(param.grad.to_local().device, torch.device("cpu"), name)

    # -- custom collectives -------------------------------------------------------------

    def test_custom_all_gather_and_reduce_scatter(self):
        self.run_subtests({"reshard_after_forward": [True, False]}, self._check_custom_comms)

    def _check_custom_comms(self, reshard_after_forward):
        ref, model = self._ref_and_model(reshard_after_forward=reshard_after_forward)
        all_gathers = {m: CountingAllGather() for m in fsdp_modules(model)}
        reduce_scatters = {m: CountingReduceScatter() for m in fsdp_modules(model)}
        for module in fsdp_modules(model):
            module.set_custom_all_gather(all_gathers[module])
            module.set_custom_reduce_scatter(reduce_scatters[module])
        num_steps = 2
        check_train_parity(self, ref, model, make_inputs, num_steps=num_steps)
        # Forward gathers every group; backward gathers them again only if they were
        # resharded after forward (an explicit True applies to the root too).
        expected = num_steps * (2 if reshard_after_forward else 1)
        for module in fsdp_modules(model):
            self.assertEqual(all_gathers[module].calls, expected)
            self.assertEqual(all_gathers[module].allocations, expected)
            self.assertEqual(reduce_scatters[module].calls, num_steps)
            self.assertEqual(reduce_scatters[module].allocations, num_steps)

    def test_custom_comms_are_called_once_per_unshard_and_reduce(self):
        _, model = self._ref_and_model(reshard_after_forward=True)
        all_gather, reduce_scatter = CountingAllGather(), CountingReduceScatter()
        block = model.layers[1]
        block.set_custom_all_gather(all_gather)
        block.set_custom_reduce_scatter(reduce_scatter)
        block.unshard()
        self.assertEqual((all_gather.calls, reduce_scatter.calls), (1, 0))
        block.unshard()  # already unsharded: no collective
        self.assertEqual(all_gather.calls, 1)
        block.reshard()
        loss = model(make_inputs(0, self.rank)).sum()
        self.assertEqual((all_gather.calls, reduce_scatter.calls), (2, 0))
        loss.backward()
        self.assertEqual((all_gather.calls, reduce_scatter.calls), (3, 1))
        # The other groups still use the default collectives.
        self.assertTrue(all(isinstance(p.grad, DTensor) for p in model.parameters()))

    def test_custom_comm_needs_one_group(self):
        """A module whose ``fully_shard`` state has no parameter group cannot take one."""
        model = nn.Sequential(nn.ReLU())
        fully_shard(model, mesh=init_device_mesh("cpu", (self.world_size,)))
        with self.assertRaises(ValueError):
            model.set_custom_all_gather(CountingAllGather())
        with self.assertRaises(ValueError):
            model.set_custom_reduce_scatter(CountingReduceScatter())

    # -- reduce-scatter knobs -----------------------------------------------------------

    def test_separate_reduce_scatter_group(self):
        ref, model = self._ref_and_model()
        model.set_separate_reduce_scatter_group(True)
        all_gather_groups: list[dist.ProcessGroup] = []
        reduce_scatter_groups: list[dist.ProcessGroup] = []

        def all_gather(output, input, group):
            all_gather_groups.append(group)

        def reduce_scatter(output, input, op, group):
            reduce_scatter_groups.append(group)

        with observe_all_gathers(all_gather), observe_reduce_scatters(reduce_scatter):
            check_train_parity(self, ref, model, make_inputs, num_steps=2)
        self.assertEqual(len(reduce_scatter_groups), 2 * (NUM_BLOCKS + 1))
        self.assertEqual(len(all_gather_groups), 2 * (2 * NUM_BLOCKS + 1))
        gather_ids = {id(g) for g in all_gather_groups}
        scatter_ids = {id(g) for g in reduce_scatter_groups}
        self.assertEqual(len(gather_ids), 1)
        # One separate group, created once and shared by every parameter group.
        self.assertEqual(len(scatter_ids), 1)
        self.assertTrue(gather_ids.isdisjoint(scatter_ids))
        all_gather_ranks = dist.get_process_group_ranks(all_gather_groups[0])
        reduce_scatter_ranks = dist.get_process_group_ranks(reduce_scatter_groups[0])
        self.assertEqual(reduce_scatter_ranks, all_gather_ranks)
        self.assertEqual(reduce_scatter_ranks, list(range(self.world_size)))
        # Turning it off goes back to the shard group.
        model.set_separate_reduce_scatter_group(False)
        reduce_scatter_groups.clear()
        with observe_reduce_scatters(reduce_scatter):
            model(make_inputs(0, self.rank)).sum().backward()
        self.assertEqual({id(g) for g in reduce_scatter_groups}, gather_ids)

    def test_reduce_scatter_max_input_buffers(self):
        self.run_subtests({"max_input_buffers": [1, 2, 8]}, self._check_max_input_buffers)

    def _check_max_input_buffers(self, max_input_buffers):
        ref, model = self._ref_and_model()
        model.set_reduce_scatter_max_input_buffers(max_input_buffers)
        check_train_parity(self, ref, model, make_inputs, num_steps=2, num_microbatches=2)
        # A reduction writes its gradients once it completes; before the j-th reduce-scatter
        # of a backward allocates its input, the oldest are completed until fewer than the
        # bound remain in flight.
        self.assertEqual(self._written_at_issue(model), self._in_flight(max_input_buffers))

    def test_reduce_scatters_complete_at_once_on_cpu_by_default(self):
        """Without a bound set, a CPU reduction completes when issued: gloo's copy of its
        input is not kept alive through the next block's backward. An explicit bound of 1
        lets one stay in flight while the next block all-gathers."""
        ref, model = self._ref_and_model()
        check_train_parity(self, ref, model, make_inputs, num_steps=2, num_microbatches=2)
        self.assertEqual(self._pending_at_backward_all_gathers(model), {0})
        model.set_reduce_scatter_max_input_buffers(1)
        self.assertIn(1, self._pending_at_backward_all_gathers(model))

    def test_all_gathers_complete_when_issued_on_cpu(self):
        """On CPU an all-gather (forward, backward or prefetch) has completed when the
        unshard that issued it returns; an explicit async unshard leaves it in flight."""
        _, model = self._ref_and_model()
        model(make_inputs(0, self.rank)).sum().backward()  # lazy init
        group = model.layers[1]._get_fsdp_state().group
        group.unshard()
        self.assertIsNone(group._all_gather.work)
        group.wait_for_unshard()
        group.reshard()
        group.unshard(async_op=True)
        self.assertIsNotNone(group._all_gather.work)
        group.wait_for_unshard()
        group.reshard()

    def _pending_at_backward_all_gathers(self, model) -> set[int]:
        """Reductions issued but not yet written, seen at each all-gather of a backward."""
        model.zero_grad()
        first_params = [model.proj.weight, *(layer.in_proj.weight for layer in model.layers)]
        issued: list[None] = []
        pending: set[int] = set()

        def all_gather(output, input, group):
            if issued:  # backward has begun reducing
                pending.add(len(issued) - sum(p.grad is not None for p in first_params))

        with observe_reduce_scatters(lambda *args: issued.append(None)):
            with observe_all_gathers(all_gather):
                model(make_inputs(0, self.rank)).sum().backward()
        return pending

    def _in_flight(self, bound: int) -> list[int]:
        """How many of the first parameters hold gradients at each reduce-scatter's issue."""
        return [max(0, j - bound + 1) for j in range(NUM_BLOCKS + 1)]

    def _written_at_issue(self, model) -> list[int]:
        model.zero_grad()
        written_at_issue: list[int] = []
        first_params = [model.proj.weight, *(layer.in_proj.weight for layer in model.layers)]

        def reduce_scatter(output, input, op, group):
            written_at_issue.append(sum(p.grad is not None for p in first_params))

        with observe_reduce_scatters(reduce_scatter):
            model(make_inputs(0, self.rank)).sum().backward()
        self.assertTrue(all(p.grad is not None for p in first_params))
        return written_at_issue
