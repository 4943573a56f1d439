"""Per-parameter meshes: ``shard_placement_fn`` returning a placement *and* a mesh for a
parameter (torch's ``ShardPlacementResult``), as for mixture-of-experts weights sharded on a
mesh of their own (see [Note: per-parameter meshes] in ``reffsdp/per_param/placement.py``).

A small MoE-like model on 4 threaded ranks: the shared parameters (router, input projection,
head) are sharded over all 4 ranks; each block's expert weights over 2 ranks, either the
``ep`` dim of a ``(rep, ep) = (2, 2)`` mesh (FSDP within each pair of ranks, no reduction
across pairs) or that whole mesh as HSDP (sharded within pairs, all-reduced across them).
So each block's ``fully_shard`` call owns two groups, one per mesh.

Trained for a few steps under reffsdp's ``fully_shard`` and under torch's on the same data,
the losses, the parameters and the collectives of each step (kind and size, in order, which
tells the groups apart: their sizes differ) are torch's. Where the installed torch has no
``ShardPlacementResult`` (before 2.12, compat entry 8) reffsdp runs alone, with stand-ins of
the same shape, and is checked against what the mesh layout implies.
"""

from __future__ import annotations

import copy
import unittest
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp import fully_shard
from reffsdp.core.comms import Collective
from reffsdp.core.compat import TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread
needs_torch_per_param_meshes = unittest.skipUnless(
    TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES,
    "torch's fully_shard has no per-parameter meshes before 2.12 (compat entry 8)",
)

AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE
DIM, HIDDEN, EXPERTS, BLOCKS = 8, 12, 4, 2
SHARD_0 = Shard(0)


@dataclass
class StandInMeshInfo:
    """What reffsdp reads of torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo``."""

    mesh: DeviceMesh
    shard_mesh_dim: int
    replicate_mesh_dim: int | None = None


@dataclass
class StandInPlacementResult:
    """What reffsdp reads of torch's ``ShardPlacementResult``."""

    placement: Shard | None
    mesh_info: Any


def placement_result(placement: Shard | None, mesh: DeviceMesh, hsdp: bool) -> Any:
    """A per-parameter placement on ``mesh``: torch's types where torch has them."""
    if not TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES:
        info = StandInMeshInfo(mesh, 1, 0) if hsdp else StandInMeshInfo(mesh, 0)
        return StandInPlacementResult(placement, info)
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    if hsdp:
        info = HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    return ShardPlacementResult(placement, info)


class MoEBlock(nn.Module):
    """A router (shared) weighing ``EXPERTS`` two-layer experts (their weights stacked)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.expert_in = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / DIM**0.5)
        self.expert_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)  # (batch, experts)
        hidden = torch.relu(torch.einsum("bd,edh->beh", x, self.expert_in))
        out = torch.einsum("beh,ehd->bed", hidden, self.expert_out)
        return x + torch.einsum("be,bed->bd", gate, out)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def is_expert(param: nn.Parameter, model: MoE) -> bool:
    return any(param is block.expert_in or param is block.expert_out for block in model.blocks)


def shard_moe(shard, model: MoE, dp: DeviceMesh, experts: Any, **kwargs: Any) -> MoE:
    """Each block on ``dp`` with its experts on ``experts`` (a placement result); the root's
    own parameters on ``dp``."""

    def place(param: nn.Parameter):
        return experts if is_expert(param, model) else None

    for block in model.blocks:
        shard(block, mesh=dp, shard_placement_fn=place, **kwargs)
    shard(model, mesh=dp, **kwargs)
    return model


def train(
    model: MoE, rank: int, steps: int, before_step: Callable[[MoE, int], None] | None = None
) -> tuple[list[float], list[tuple[list, list]]]:
    """Losses and each step's ``(forward, backward)`` collectives, ``(kind, bytes)`` in order;
    ``before_step(model, step)`` may change settings first."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    losses, comms = [], []
    for step in range(steps):
        if before_step is not None:
            before_step(model, step)
        x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(100 * step + rank))
        with CommCounter() as forward:
            loss = model(x).square().mean()
        with CommCounter() as backward:
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        comms.append((forward.get_comm_sequence(), backward.get_comm_sequence()))
    return losses, comms


class TestPerParamMeshes(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def _meshes(self) -> tuple[DeviceMesh, DeviceMesh]:
        dp = init_device_mesh("cpu", (4,))
        rep_ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "ep"))
        return dp, rep_ep

    def _experts(self, rep_ep: DeviceMesh, hsdp: bool, placement: Shard | None = SHARD_0):
        return placement_result(placement, rep_ep if hsdp else rep_ep["ep"], hsdp)

    @needs_torch_per_param_meshes
    def test_training_matches_torch(self):
        self.run_subtests(
            {"hsdp": [False, True], "reshard_after_forward": [True, False, None, 2]},
            self._check_training_matches_torch,
        )

    def _check_training_matches_torch(self, hsdp: bool, reshard_after_forward):
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        dp, rep_ep = self._meshes()
        model = MoE()
        self.sync_module_states(model)
        ref = copy.deepcopy(model)
        kwargs = dict(reshard_after_forward=reshard_after_forward)
        shard_moe(fully_shard, model, dp, self._experts(rep_ep, hsdp), **kwargs)
        shard_moe(torch_fully_shard, ref, dp, self._experts(rep_ep, hsdp), **kwargs)
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            self.assertEqual(param.placements, ref_param.placements, name)
            self.assertEqual(param.device_mesh, ref_param.device_mesh, name)
        losses, comms = train(model, self.rank, steps=3)
        ref_losses, ref_comms = train(ref, self.rank, steps=3)
        self.assertEqual(losses, ref_losses)
        self.assertEqual(comms, ref_comms)
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param.to_local(), ref_param.to_local(), msg=name)

    def test_each_group_gathers_and_reduces_over_its_own_mesh(self):
        """What the layout implies, on every torch: per block, one all-gather in forward per
        group, and in backward one reduce-scatter per group (with HSDP experts, then one
        all-reduce across the pairs); the experts' over 2 ranks, the rest over 4."""
        self.run_subtests({"hsdp": [False, True]}, self._check_groups_own_meshes)

    def _check_groups_own_meshes(self, hsdp: bool):
        dp, rep_ep = self._meshes()
        model = MoE()
        self.sync_module_states(model)
        shard_moe(fully_shard, model, dp, self._experts(rep_ep, hsdp), reshard_after_forward=True)
        expert_mesh = rep_ep if hsdp else rep_ep["ep"]
        expert_placements = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
        for block in model.blocks:
            for param in (block.expert_in, block.expert_out):
                self.assertEqual(param.device_mesh, expert_mesh)
                self.assertEqual(param.placements, expert_placements)
                self.assertEqual(param.to_local().shape[0], EXPERTS // 2)
            self.assertEqual(len(block._get_fsdp_state().groups), 2)
            self.assertEqual(block.router.weight.device_mesh, dp)
        seen: list[tuple[Collective, int]] = []

        def record(kind: Collective, tensor: torch.Tensor, group: Any) -> None:
            seen.append((kind, dist.get_world_size(group)))

        from reffsdp.testing.patching import observe_collectives

        with observe_collectives(record):
            model(torch.randn(3, DIM)).sum().backward()
        per_block_forward = [(AG, 4), (AG, 2)]
        self.assertEqual(seen[: 1 + 2 * BLOCKS], [(AG, 4)] + per_block_forward * BLOCKS)
        expert_reduce = [(RS, 2), (AR, 2)] if hsdp else [(RS, 2)]
        backward = Counter(seen[1 + 2 * BLOCKS :])
        expected = [(AG, 4)] * (BLOCKS + 1) + [(AG, 2)] * BLOCKS + [(RS, 4)] * (BLOCKS + 1)
        self.assertEqual(backward, Counter(expected + expert_reduce * BLOCKS))

    def test_negative_and_default_placements_on_a_mesh_of_their_own(self):
        """``ShardPlacementResult(None, ...)`` shards dim 0, ``Shard(-1)`` the last dim."""
        dp, rep_ep = self._meshes()
        for placement, dim in ((None, 0), (Shard(-1), 2)):
            model = MoE()
            shard_moe(fully_shard, model, dp, self._experts(rep_ep, False, placement))
            self.assertEqual(model.blocks[0].expert_in.placements, (Shard(dim),))
            self.assertIsInstance(model.blocks[0].expert_in, DTensor)


def fsdp_modules(model: MoE) -> list[nn.Module]:
    return [*model.blocks, model]


def _no_sync_first(model: MoE, step: int) -> None:
    model.set_requires_gradient_sync(step > 0)


def _no_all_reduce_first(model: MoE, step: int) -> None:
    model.set_requires_all_reduce(step > 0)


def _keep_after_forward_first(model: MoE, step: int) -> None:
    model.set_reshard_after_forward(step > 0)


def _keep_after_backward_first(model: MoE, step: int) -> None:
    model.set_reshard_after_backward(step > 0)


def _divide_by_three(model: MoE, step: int) -> None:
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(3.0)


def _sum_only(model: MoE, step: int) -> None:
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)


def _separate_reduce_scatter_group(model: MoE, step: int) -> None:
    if step == 0:
        model.set_separate_reduce_scatter_group()


def _explicit_prefetch(model: MoE, step: int) -> None:
    first, second = model.blocks
    first.set_modules_to_forward_prefetch([second])
    second.set_modules_to_backward_prefetch([first])


def _two_input_buffers(model: MoE, step: int) -> None:
    model.set_reduce_scatter_max_input_buffers(2)


# Each setting, applied alike to reffsdp's model and torch's, and whether the experts are HSDP.
SETTINGS: dict[str, tuple[Callable[[MoE, int], None], bool]] = {
    "gradient sync off, then on": (_no_sync_first, False),
    "all-reduce off, then on": (_no_all_reduce_first, True),
    "no reshard after forward, then reshard": (_keep_after_forward_first, False),
    "no reshard after backward, then reshard": (_keep_after_backward_first, True),
    "gradient divide factor": (_divide_by_three, True),
    "sum-only reductions": (_sum_only, True),
    "separate reduce-scatter group": (_separate_reduce_scatter_group, False),
    "explicit prefetch": (_explicit_prefetch, False),
    "two reduce-scatter input buffers": (_two_input_buffers, False),
}


@needs_torch_per_param_meshes
class TestEveryGroupLikeTorch(FSDPTestMultiThread):
    """Settings, prefetching and mixed precision reach every group of a call, as in torch."""

    @property
    def world_size(self) -> int:
        return 4

    def _compare(self, before_step=None, hsdp: bool = False, **kwargs: Any) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        from reffsdp import MixedPrecisionPolicy

        dp = init_device_mesh("cpu", (4,))
        rep_ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "ep"))
        experts = rep_ep if hsdp else rep_ep["ep"]
        model = MoE()
        self.sync_module_states(model)
        ref = copy.deepcopy(model)
        param_dtype = kwargs.pop("param_dtype", None)
        ours_kwargs = dict(kwargs, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
        torch_kwargs = dict(kwargs, mp_policy=TorchMixedPrecisionPolicy(param_dtype=param_dtype))
        shard_moe(fully_shard, model, dp, placement_result(None, experts, hsdp), **ours_kwargs)
        shard_moe(torch_fully_shard, ref, dp, placement_result(None, experts, hsdp), **torch_kwargs)
        losses, comms = train(model, self.rank, 2, before_step)
        ref_losses, ref_comms = train(ref, self.rank, 2, before_step)
        self.assertEqual(losses, ref_losses)
        self.assertEqual(comms, ref_comms)
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param.to_local(), ref_param.to_local(), msg=name)

    def test_settings_reach_every_group(self):
        self.run_subtests(
            {"setting": list(SETTINGS)}, lambda setting: self._compare(*SETTINGS[setting])
        )

    def test_mixed_precision(self):
        self._compare(hsdp=True, param_dtype=torch.bfloat16)

    def test_one_communication_setters_refuse_several_groups(self):
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        dp = init_device_mesh("cpu", (4,))
        rep_ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "ep"))
        ours = shard_moe(fully_shard, MoE(), dp, placement_result(None, rep_ep["ep"], False))
        theirs = shard_moe(
            torch_fully_shard, MoE(), dp, placement_result(None, rep_ep["ep"], False)
        )
        calls = {
            "set_custom_all_gather": lambda m: m.set_custom_all_gather(object()),
            "set_custom_reduce_scatter": lambda m: m.set_custom_reduce_scatter(object()),
            "set_all_reduce_hook": lambda m: m.set_all_reduce_hook(lambda grad: None),
        }
        for method, call in calls.items():
            phrase = f"{method} is not supported with multiple param groups"
            for model in (ours.blocks[0], theirs.blocks[0]):
                with self.subTest(method=method, model=type(model).__module__):
                    with self.assertRaisesRegex(ValueError, phrase):
                        call(model)
            call(ours)  # the root has one group


class TestEveryGroup(FSDPTestMultiThread):
    """The module methods and the iteration's recovery paths cover every group, on every
    torch (placement results of the stand-in shape where torch has none)."""

    @property
    def world_size(self) -> int:
        return 4

    def _models(self, count: int, **kwargs: Any) -> list[MoE]:
        """``count`` sharded copies of one model, rank 0's on every rank."""
        dp = init_device_mesh("cpu", (4,))
        rep_ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "ep"))
        source = MoE()
        self.sync_module_states(source)
        experts = placement_result(None, rep_ep, hsdp=True)
        models = [copy.deepcopy(source) for _ in range(count)]
        return [shard_moe(fully_shard, model, dp, experts, **kwargs) for model in models]

    def _model(self, **kwargs: Any) -> MoE:
        return self._models(1, **kwargs)[0]

    def _x(self, step: int = 0) -> torch.Tensor:
        return torch.randn(3, DIM, generator=torch.Generator().manual_seed(10 * step + self.rank))

    def test_unshard_and_reshard(self):
        model = self._model()
        block = model.blocks[0]
        for async_op in (False, True):
            handle = block.unshard(async_op=async_op)
            if handle is not None:
                handle.wait()
            for name, param in block.named_parameters():
                self.assertNotIsInstance(param, DTensor, name)  # both groups unsharded
            self.assertEqual(block.expert_in.shape, (EXPERTS, DIM, HIDDEN))
            block.reshard()
            for name, param in block.named_parameters():
                self.assertIsInstance(param, DTensor, name)

    def test_state_dict_between_forward_and_backward(self):
        """Saving sees every group's sharded DTensors, even while forward left them
        unsharded; loading it back into another sharded model gives the same values."""
        model, other = self._models(2, reshard_after_forward=False)
        loss = model(self._x()).sum()
        state = model.state_dict()
        for name, value in state.items():
            self.assertIsInstance(value, DTensor, name)
        loss.backward()
        with torch.no_grad():
            for param in other.parameters():
                param.zero_()
        other.load_state_dict(state)
        for (name, param), mine in zip(other.named_parameters(), model.parameters()):
            torch.testing.assert_close(param.to_local(), mine.to_local(), msg=name)
        torch.testing.assert_close(other(self._x(1)), model(self._x(1)))

    def test_reset_iter_state_after_a_failed_forward(self):
        """A forward that fails inside the second block leaves both of the first block's
        groups (and the second's) unsharded; after reset_iter_state the next steps train as
        a model that never failed."""
        model, clean = self._models(2)

        def fail(module: nn.Module, args: Any) -> None:
            raise RuntimeError("planted failure")

        handle = model.blocks[1].router.register_forward_pre_hook(fail)
        with self.assertRaisesRegex(RuntimeError, "planted failure"):
            model(self._x())
        handle.remove()
        model.reset_iter_state()
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
        losses, _ = train(model, self.rank, 2)
        clean_losses, _ = train(clean, self.rank, 2)
        self.assertEqual(losses, clean_losses)

    def test_manual_finalization(self):
        """finalize_backward() reduces every group, last first, as the end of backward does."""
        auto, manual = self._models(2)
        manual.set_manual_backward_finalization(True)
        for model in (auto, manual):
            model(self._x()).sum().backward()
        manual.finalize_backward()
        for (name, param), ref in zip(manual.named_parameters(), auto.parameters()):
            torch.testing.assert_close(param.grad.to_local(), ref.grad.to_local(), msg=name)

    def test_activation_checkpointing_recomputes_with_every_group(self):
        from torch.utils.checkpoint import checkpoint

        model, plain = self._models(2)
        for block in model.blocks:
            forward = block.forward
            block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)
        for each in (model, plain):
            each(self._x()).sum().backward()
        for (name, param), ref in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(param.grad.to_local(), ref.grad.to_local(), msg=name)

    def test_setters_reach_every_group(self):
        model = self._model()
        block = model.blocks[0]
        groups = block._get_fsdp_state().groups
        self.assertEqual(len(groups), 2)
        block.set_unshard_in_backward(False)
        block.set_reduce_scatter_unused_params(True)
        block.set_reshard_after_backward(False)
        block.set_keep_unsharded_storage(True)
        block.set_allocate_memory_from_process_group_for_comm(True)
        for group in groups:
            self.assertFalse(group.settings.unshard_in_backward, group.name)
            self.assertTrue(group.settings.reduce_scatter_unused_params, group.name)
            self.assertFalse(group.settings.reshard_after_backward, group.name)
            self.assertTrue(all(param.keep_unsharded_storage for param in group.members))
