"""HSDP: ``fully_shard`` on a 2D ``(dp_replicate, dp_shard)`` mesh trains exactly like DDP.

Parameters are sharded within each shard group and replicated across the replicate groups:
all-gathers and reduce-scatters run over the shard group, then each reduced shard is
all-reduced over the replicate group (SPEC 2.3, 3.2). On 4 ranks, ``mesh_hsdp(2, 2)`` puts
ranks ``{0, 1}`` and ``{2, 3}`` in shard groups and ``{0, 2}``, ``{1, 3}`` in replicate groups.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp import MixedPrecisionPolicy, fully_shard
from reffsdp.core import comms
from reffsdp.core.comms import Collective
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.meshes import mesh_hsdp
from reffsdp.testing.models import MLPBlocks
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import all_reduce_off, check_train_parity, gradient_sync_off
from reffsdp.testing.patching import patch_all_gather, patch_all_reduce, patch_reduce_scatter

pytestmark = pytest.mark.multithread

AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE
DIM = 8
NUM_BLOCKS = 2


make_inputs = random_inputs(2, DIM)


def shard(model: MLPBlocks, mesh, **kwargs) -> MLPBlocks:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def group_padded_numels(model: MLPBlocks, shard_size: int) -> list[int]:
    """Elements of each group's all-gather output (= reduce-scatter input), root first."""

    def padded(params) -> int:
        return sum(
            shard_size * math.ceil(p.shape[0] / shard_size) * math.prod(p.shape[1:]) for p in params
        )

    return [padded(model.proj.parameters())] + [padded(m.parameters()) for m in model.layers]


class TestHSDP(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def _ref_and_model(self) -> tuple[nn.Module, MLPBlocks]:
        model = MLPBlocks(DIM, (3, 4))
        self.sync_module_states(model)
        return copy.deepcopy(model), model

    def test_train_parity(self):
        self.run_subtests({"reshard_after_forward": [True, False, None]}, self._check_parity)

    def _check_parity(self, reshard_after_forward):
        ref, model = self._ref_and_model()
        mesh = mesh_hsdp(2, 2)
        shard(model, mesh, reshard_after_forward=reshard_after_forward)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
            self.assertEqual(param.placements, (Replicate(), Shard(0)), name)
            self.assertEqual(param.device_mesh, mesh, name)
        check_train_parity(self, ref, model, make_inputs, num_steps=2)

    def test_mixed_precision_parity(self):
        """bf16 compute, fp32 reduction, against a reference that applies the same casts.

        The reference computes in a bf16 copy of its fp32 parameters, up-casts the bf16
        gradients, averages them in fp32 over all ranks and steps the fp32 parameters: what
        HSDP does, minus the sharding. Only the fp32 summation order can differ.
        """
        torch.manual_seed(0)
        ref, model = self._ref_and_model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard(model, mesh_hsdp(2, 2), mp_policy=policy)
        optim = torch.optim.SGD(model.parameters(), lr=1e-1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=1e-1)
        seen_dtypes: list[torch.dtype] = []
        model.layers[0].in_proj.register_forward_pre_hook(
            lambda module, args: seen_dtypes.append(module.weight.dtype)
        )
        for step in range(2):
            x = make_inputs(step, self.rank)
            ref_compute = copy.deepcopy(ref).to(torch.bfloat16)
            ref_loss = ref_compute(x.to(torch.bfloat16)).float().sum()
            ref_loss.backward()
            for param, compute_param in zip(ref.parameters(), ref_compute.parameters()):
                param.grad = compute_param.grad.float()
                dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
            loss = model(x).float().sum()
            loss.backward()
            torch.testing.assert_close(loss, ref_loss)
            for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
                self.assertEqual(param.dtype, torch.float32, name)
                self.assertEqual(param.grad.dtype, torch.float32, name)
                torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, msg=name)
            optim.step()
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
            for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(param.full_tensor(), ref_param.detach(), msg=name)
        self.assertEqual(seen_dtypes, [torch.bfloat16] * 2)

    def test_comm_counts_and_groups_per_step(self):
        """Per step: RS over the shard group = AR over the replicate group = #groups."""
        model = MLPBlocks(DIM, (3, 4))
        numels = group_padded_numels(model, shard_size=2)
        mesh = mesh_hsdp(2, 2)
        shard(model, mesh, reshard_after_forward=True)
        shard_ranks = dist.get_process_group_ranks(mesh.get_group("dp_shard"))
        replicate_ranks = dist.get_process_group_ranks(mesh.get_group("dp_replicate"))
        self.assertEqual(shard_ranks, [self.rank // 2 * 2, self.rank // 2 * 2 + 1])
        self.assertEqual(replicate_ranks, [self.rank % 2, self.rank % 2 + 2])
        groups = NUM_BLOCKS + 1
        seen: dict[Collective, list[list[int]]] = {AG: [], RS: [], AR: []}

        def all_gather(output, input, group=None, async_op=False):
            seen[AG].append(dist.get_process_group_ranks(group))
            return comms.torch_all_gather()(output, input, group=group, async_op=async_op)

        def reduce_scatter(output, input, op=None, group=None, async_op=False):
            seen[RS].append(dist.get_process_group_ranks(group))
            return comms.torch_reduce_scatter()(
                output, input, op=op, group=group, async_op=async_op
            )

        def all_reduce(tensor, op=None, group=None, async_op=False):
            seen[AR].append(dist.get_process_group_ranks(group))
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

        for step in range(2):
            for calls in seen.values():
                calls.clear()
            with (
                patch_all_gather(all_gather),
                patch_reduce_scatter(reduce_scatter),
                patch_all_reduce(all_reduce),
            ):
                with CommCounter() as forward:
                    loss = model(make_inputs(step, self.rank)).sum()
                with CommCounter() as backward:
                    loss.backward()
            self.assertEqual(forward.get_comm_counts(), {AG: groups})
            self.assertEqual(forward.get_comm_bytes(), {AG: 4 * sum(numels)})
            self.assertEqual(backward.get_comm_counts(), {AG: groups, RS: groups, AR: groups})
            self.assertEqual(backward.get_comm_bytes()[RS], 4 * sum(numels))
            # The all-reduce moves one shard: the reduce-scatter input over the shard size.
            self.assertEqual(backward.get_comm_bytes()[AR], 4 * sum(numels) // 2)
            self.assertEqual(seen[AG], [shard_ranks] * 2 * groups)
            self.assertEqual(seen[RS], [shard_ranks] * groups)
            self.assertEqual(seen[AR], [replicate_ranks] * groups)

    def test_requires_all_reduce_false_accumulates_like_ddp(self):
        """Reduce-scatter every microbatch, all-reduce only the last; DDP ``no_sync`` result."""
        ref, model = self._ref_and_model()
        shard(model, mesh_hsdp(2, 2))
        groups = NUM_BLOCKS + 1
        model.set_requires_all_reduce(False)
        for microbatch in range(2):
            with CommCounter() as counter:
                model(make_inputs(microbatch, self.rank)).sum().backward()
            self.assertEqual(counter.get_comm_counts()[RS], groups)
            self.assertEqual(counter.get_comm_counts()[AR], 0)
            # The reduced shards wait in the partial buffer: no gradient is written yet.
            self.assertTrue(all(p.grad is None for p in model.parameters()))
        model.set_requires_all_reduce(True)
        with CommCounter() as counter:
            model(make_inputs(2, self.rank)).sum().backward()
        self.assertEqual(counter.get_comm_counts()[RS], groups)
        self.assertEqual(counter.get_comm_counts()[AR], groups)
        self.assertTrue(all(p.grad is not None for p in model.parameters()))
        model.zero_grad()
        # The same schedule against DDP's no_sync, checked step by step.
        ref2, model2 = self._ref_and_model()
        shard(model2, mesh_hsdp(2, 2))
        check_train_parity(
            self,
            ref2,
            model2,
            make_inputs,
            num_steps=2,
            num_microbatches=3,
            no_sync=all_reduce_off,
        )

    def test_requires_gradient_sync_false_skips_both(self):
        ref, model = self._ref_and_model()
        shard(model, mesh_hsdp(2, 2))
        groups = NUM_BLOCKS + 1
        with gradient_sync_off(model):
            with CommCounter() as counter:
                model(make_inputs(0, self.rank)).sum().backward()
        self.assertEqual(counter.get_comm_counts()[RS], 0)
        self.assertEqual(counter.get_comm_counts()[AR], 0)
        self.assertTrue(all(p.grad is None for p in model.parameters()))
        with CommCounter() as counter:
            model(make_inputs(1, self.rank)).sum().backward()
        self.assertEqual(counter.get_comm_counts()[RS], groups)
        self.assertEqual(counter.get_comm_counts()[AR], groups)
        model.zero_grad()
        ref2, model2 = self._ref_and_model()
        shard(model2, mesh_hsdp(2, 2))
        check_train_parity(
            self,
            ref2,
            model2,
            make_inputs,
            num_steps=2,
            num_microbatches=2,
            no_sync=gradient_sync_off,
        )


class TestHSDPEdgeShapes(FSDPTestMultiThread):
    """Degenerate 2D meshes on 2 ranks: pure replication (2x1) and pure sharding (1x2)."""

    @property
    def world_size(self) -> int:
        return 2

    def test_train_parity(self):
        self.run_subtests({"shape": [(2, 1), (1, 2)]}, self._check)

    def _check(self, shape):
        model = MLPBlocks(DIM, (3, 4))
        self.sync_module_states(model)
        ref = copy.deepcopy(model)
        mesh = mesh_hsdp(*shape)
        shard(model, mesh, reshard_after_forward=True)
        for name, param in model.named_parameters():
            self.assertEqual(param.placements, (Replicate(), Shard(0)), name)
        with CommCounter() as counter:
            model(make_inputs(0, self.rank)).sum().backward()
        counts = counter.get_comm_counts()
        groups = NUM_BLOCKS + 1
        if shape == (2, 1):  # one-rank shard groups: nothing to gather or scatter
            self.assertEqual((counts[AG], counts[RS], counts[AR]), (0, 0, groups))
        else:
            self.assertEqual((counts[AG], counts[RS]), (2 * groups, groups))
        model.zero_grad()
        check_train_parity(self, ref, model, make_inputs, num_steps=2)


class TestHSDPIntReshard(FSDPTestMultiThread):
    """``reshard_after_forward=2`` within 4-rank shard groups of a 2x4 mesh."""

    @property
    def world_size(self) -> int:
        return 8

    def test_int_reshard_after_forward(self):
        model = MLPBlocks(DIM, (3, 4))
        self.sync_module_states(model)
        ref = copy.deepcopy(model)
        shard(model, mesh_hsdp(2, 4), reshard_after_forward=2)
        groups = NUM_BLOCKS + 1
        sizes: list[int] = []

        def all_gather(output, input, group=None, async_op=False):
            sizes.append(group.size())
            return comms.torch_all_gather()(output, input, group=group, async_op=async_op)

        with patch_all_gather(all_gather):
            with CommCounter() as counter:
                model(make_inputs(0, self.rank)).sum().backward()
        self.assertEqual(counter.get_comm_counts(), {AG: 2 * groups, RS: groups, AR: groups})
        # Forward gathers over the 4-rank shard group, backward over 2-rank subgroups.
        self.assertEqual(sizes, [4] * groups + [2] * groups)
        model.zero_grad()
        check_train_parity(self, ref, model, make_inputs, num_steps=2)
