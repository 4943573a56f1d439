"""HSDP: ``fully_shard`` on a 2D ``(dp_replicate, dp_shard)`` mesh trains exactly like DDP.

Parameters are sharded within each shard group and replicated across the replicate groups:
all-gathers and reduce-scatters run over the shard group, then each reduced shard is
all-reduced over the replicate group (SPEC 2.3, 3.2). On 4 ranks, ``mesh_hsdp(2, 2)`` puts
ranks ``{0, 1}`` and ``{2, 3}`` in shard groups and ``{0, 2}``, ``{1, 3}`` in replicate groups.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp import MixedPrecisionPolicy
from reffsdp.core.comms import Collective
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.comm_counter import CommCounter, all_gather_numel
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.meshes import mesh_hsdp
from reffsdp.testing.models import MLPBlocks
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import (
    LowPrecisionCompute,
    Passthrough,
    all_reduce_off,
    check_train_parity,
    gradient_sync_off,
)
from reffsdp.testing.patching import observe_all_gathers, observe_reduce_scatters, patch_all_reduce

pytestmark = pytest.mark.multithread

AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE
DIM = 8
NUM_BLOCKS = 2


make_inputs = random_inputs(2, DIM)


def group_padded_numels(model: MLPBlocks, shard_size: int) -> list[int]:
    """Elements of each group's all-gather output (= reduce-scatter input), root first."""
    groups = [model.proj, *model.layers]
    return [all_gather_numel([p.shape for p in g.parameters()], shard_size) for g in groups]


def hsdp_blocks(mesh, **fsdp_kwargs) -> tuple[MLPBlocks, MLPBlocks]:
    """``(reference, model)``: two blocks and the root's ``proj``, sharded on ``mesh``."""
    ref, model = reference_and_model(MLPBlocks(DIM, (3, 4)))
    return ref, shard_bottom_up(model, model.layers, mesh=mesh, **fsdp_kwargs)


class HSDPTests:
    """HSDP on a 2x2 mesh: placements, collectives per backward, and parity with DDP.

    Also run over gloo processes (``tests/multiprocess/test_fully_shard_hsdp_gloo.py``).
    """

    @property
    def world_size(self) -> int:
        return 4

    def test_train_parity(self):
        self.run_subtests({"reshard_after_forward": [True, False, None]}, self._check_parity)

    def _check_parity(self, reshard_after_forward):
        mesh = mesh_hsdp(2, 2)
        ref, model = hsdp_blocks(mesh, reshard_after_forward=reshard_after_forward)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
            self.assertEqual(param.placements, (Replicate(), Shard(0)), name)
            self.assertEqual(param.device_mesh, mesh, name)
        groups = NUM_BLOCKS + 1
        with CommCounter() as counter:
            model(make_inputs(0, self.rank)).sum().backward()
        # None reshards every group but the root, whose parameters backward needs first.
        backward_gathers = {True: groups, False: 0, None: NUM_BLOCKS}[reshard_after_forward]
        self.assertEqual(
            counter.get_comm_counts(), {AG: groups + backward_gathers, RS: groups, AR: groups}
        )
        # The all-reduce moves one shard of what the 2-rank shard group reduce-scatters.
        self.assertEqual(counter.get_comm_bytes()[RS], 2 * counter.get_comm_bytes()[AR])
        model.zero_grad()
        check_train_parity(self, ref, model, make_inputs, num_steps=2)

    def test_requires_all_reduce_false_accumulates_like_ddp(self):
        """Reduce-scatter every microbatch, all-reduce only the last; DDP ``no_sync`` result."""
        _, model = hsdp_blocks(mesh_hsdp(2, 2))
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
        self._check_accumulation_parity(all_reduce_off, num_microbatches=3)

    def test_requires_gradient_sync_false_skips_both(self):
        _, model = hsdp_blocks(mesh_hsdp(2, 2))
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
        self._check_accumulation_parity(gradient_sync_off, num_microbatches=2)

    def _check_accumulation_parity(self, no_sync, num_microbatches: int):
        """The same schedule on a fresh model against DDP's ``no_sync``, step by step."""
        ref, model = hsdp_blocks(mesh_hsdp(2, 2))
        check_train_parity(
            self,
            ref,
            model,
            make_inputs,
            num_steps=2,
            num_microbatches=num_microbatches,
            no_sync=no_sync,
        )


class TestHSDP(HSDPTests, FSDPTestMultiThread):
    pass


class TestHSDPMixedPrecisionAndGroups(FSDPTestMultiThread):
    """Threads only (each gloo test pays for starting its processes): the casts, and the
    process group every collective runs over."""

    @property
    def world_size(self) -> int:
        return 4

    def test_mixed_precision_parity(self):
        """bf16 compute, fp32 reduction, against a DDP reference that makes the same casts.

        ``LowPrecisionCompute`` computes in bf16 copies of the fp32 parameters and DDP
        averages the up-cast gradients in fp32 over all ranks: what HSDP does, minus the
        sharding. Only the fp32 summation order can differ.
        """
        torch.manual_seed(0)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ref, model = hsdp_blocks(mesh_hsdp(2, 2), mp_policy=policy)
        seen_dtypes: list[torch.dtype] = []
        model.layers[0].in_proj.register_forward_pre_hook(
            lambda module, args: seen_dtypes.append(module.weight.dtype)
        )
        check_train_parity(
            self,
            LowPrecisionCompute(ref, torch.bfloat16),
            Passthrough(model),
            make_inputs,
            num_steps=2,
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=1e-1),
        )
        self.assertEqual(seen_dtypes, [torch.bfloat16] * 2)
        for name, param in model.named_parameters():
            self.assertEqual(param.dtype, torch.float32, name)
            self.assertEqual(param.grad.dtype, torch.float32, name)

    def test_comm_counts_and_groups_per_step(self):
        """Per step: RS over the shard group = AR over the replicate group = #groups."""
        model = MLPBlocks(DIM, (3, 4))
        numels = group_padded_numels(model, shard_size=2)
        mesh = mesh_hsdp(2, 2)
        shard_bottom_up(model, model.layers, mesh=mesh, reshard_after_forward=True)
        shard_ranks = dist.get_process_group_ranks(mesh.get_group("dp_shard"))
        replicate_ranks = dist.get_process_group_ranks(mesh.get_group("dp_replicate"))
        self.assertEqual(shard_ranks, [self.rank // 2 * 2, self.rank // 2 * 2 + 1])
        self.assertEqual(replicate_ranks, [self.rank % 2, self.rank % 2 + 2])
        groups = NUM_BLOCKS + 1
        seen: dict[Collective, list[list[int]]] = {AG: [], RS: [], AR: []}

        def all_gather(output, input, group):
            seen[AG].append(dist.get_process_group_ranks(group))

        def reduce_scatter(output, input, op, group):
            seen[RS].append(dist.get_process_group_ranks(group))

        def all_reduce(tensor, op=None, group=None, async_op=False):
            seen[AR].append(dist.get_process_group_ranks(group))
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

        for step in range(2):
            for calls in seen.values():
                calls.clear()
            with (
                observe_all_gathers(all_gather),
                observe_reduce_scatters(reduce_scatter),
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


class TestHSDPEdgeShapes(FSDPTestMultiThread):
    """Degenerate 2D meshes on 2 ranks: pure replication (2x1) and pure sharding (1x2)."""

    @property
    def world_size(self) -> int:
        return 2

    def test_train_parity(self):
        self.run_subtests({"shape": [(2, 1), (1, 2)]}, self._check)

    def _check(self, shape):
        ref, model = hsdp_blocks(mesh_hsdp(*shape), reshard_after_forward=True)
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
        ref, model = hsdp_blocks(mesh_hsdp(2, 4), reshard_after_forward=2)
        groups = NUM_BLOCKS + 1
        sizes: list[int] = []
        with observe_all_gathers(lambda output, input, group: sizes.append(group.size())):
            with CommCounter() as counter:
                model(make_inputs(0, self.rank)).sum().backward()
        self.assertEqual(counter.get_comm_counts(), {AG: 2 * groups, RS: groups, AR: groups})
        # Forward gathers over the 4-rank shard group, backward over 2-rank subgroups.
        self.assertEqual(sizes, [4] * groups + [2] * groups)
        model.zero_grad()
        check_train_parity(self, ref, model, make_inputs, num_steps=2)
