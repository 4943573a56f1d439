"""``fully_shard(..., mesh=spmd_mesh, dp_mesh_dims=...)``: data parallelism named on the mesh
the parameters already live on (SPEC 2.3, [Note: SPMD meshes] in ``reffsdp/per_param/mesh.py``).

Each of two :class:`MLP` blocks is made tensor parallel over the ``tp`` dim of the full mesh
(``in_proj`` column-wise, ``out_proj`` row-wise), with its parameters DTensors on that whole
mesh and ``Replicate()`` on every other dim. (The blocks have the same shapes: DTensor's
sharding propagation is costly on 3D meshes the first time it meets an op and shape, and
every thread of the harness pays it.) ``fully_shard`` then
shards (or only replicates) over the named data-parallel dims. As in the TP tests, the
ranks of one TP group (neighbouring ranks, ``tp`` is the innermost dim) get the same inputs,
so a DDP reference over all ranks averages exactly what FSDP averages.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import _StridedShard

from reffsdp import DataParallelMeshDims, fully_shard
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity

pytestmark = pytest.mark.multithread

DIM = 8
TP = 2
# Placement on the ``tp`` dim of each linear's parameters: column-wise, then row-wise.
TP_PLACEMENTS = {
    "in_proj": {"weight": Shard(0), "bias": Shard(0)},
    "out_proj": {"weight": Shard(1), "bias": Replicate()},
}


# Same inputs on the ranks of one TP group, different across TP groups.
make_inputs = random_inputs(2, DIM, same_within=TP)


def spmd_mesh(**sizes: int) -> DeviceMesh:
    return init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))


def on_tp(mesh: DeviceMesh, placement: Placement) -> list[Placement]:
    """``placement`` on the ``tp`` dim, ``Replicate()`` on every other dim of ``mesh``."""
    placements: list[Placement] = [Replicate()] * mesh.ndim
    placements[mesh.mesh_dim_names.index("tp")] = placement
    return placements


def tensor_parallel(model: nn.Sequential, mesh: DeviceMesh) -> nn.Sequential:
    """Column-wise ``in_proj`` and row-wise ``out_proj`` over ``tp``, on the whole ``mesh``.

    ``parallelize_module`` only takes a 1D mesh, so the two styles are spelled out: inputs
    enter as DTensors (replicated, then sharded on the hidden dim) and outputs leave as
    local tensors (row-wise partial sums all-reduced over ``tp`` first).
    """
    for block in model:
        for linear_name, placements in TP_PLACEMENTS.items():
            linear = getattr(block, linear_name)
            for name, placement in placements.items():
                param = distribute_tensor(
                    getattr(linear, name).detach(),
                    mesh,
                    on_tp(mesh, placement),
                    src_data_rank=None,
                )
                linear.register_parameter(name, nn.Parameter(param))
        block.in_proj.register_forward_pre_hook(
            lambda _, args: DTensor.from_local(args[0], mesh, on_tp(mesh, Replicate()))
        )
        block.in_proj.register_forward_hook(lambda _m, _a, out: out.to_local())
        block.out_proj.register_forward_pre_hook(
            lambda _, args: DTensor.from_local(args[0], mesh, on_tp(mesh, Shard(1)))
        )
        block.out_proj.register_forward_hook(
            lambda _m, _a, out: out.redistribute(mesh, on_tp(mesh, Replicate())).to_local()
        )
    return model


def expected_placements(mesh: DeviceMesh, dims: DataParallelMeshDims, fqn: str) -> tuple:
    """SPEC 2.3: the DP shard dims shard dim 0 (strided when ``tp`` shards it too)."""
    linear_name, param_name = fqn.split(".")[-2:]
    tp_placement = TP_PLACEMENTS[linear_name][param_name]
    placements = on_tp(mesh, tp_placement)
    for name in dims.shard_names:
        dim = mesh.mesh_dim_names.index(name)
        strided = tp_placement == Shard(0) and dim < mesh.mesh_dim_names.index("tp")
        placements[dim] = _StridedShard(0, split_factor=TP) if strided else Shard(0)
    return tuple(placements)


class DpMeshDimsMixin:
    def _models(self, mesh: DeviceMesh) -> tuple[nn.Module, nn.Sequential]:
        ref, model = reference_and_model(nn.Sequential(MLP(DIM), MLP(DIM)))
        return ref, tensor_parallel(model, mesh)

    def _check_parity(self, mesh: DeviceMesh, dims: DataParallelMeshDims) -> None:
        ref, model = self._models(mesh)
        shard_bottom_up(model, model, mesh=mesh, dp_mesh_dims=dims)
        for fqn, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, fqn)
            self.assertEqual(param.device_mesh, mesh, fqn)
            self.assertEqual(param.placements, expected_placements(mesh, dims, fqn), fqn)
        check_train_parity(self, ref, model, make_inputs, num_steps=2)
        # Unsharded: the original DTensors, replicated on the data-parallel dims.
        model[0].unshard()
        for fqn, param in model[0].named_parameters():
            linear_name, param_name = fqn.split(".")
            expected = tuple(on_tp(mesh, TP_PLACEMENTS[linear_name][param_name]))
            self.assertEqual(param.device_mesh, mesh, fqn)
            self.assertEqual(param.placements, expected, fqn)
        model[0].reshard()


class TestDpMeshDims2D(DpMeshDimsMixin, FSDPTestMultiThread):
    """4 ranks: ``(dp_shard=2, tp=2)`` and ``(dp_replicate=2, tp=2)``."""

    @property
    def world_size(self) -> int:
        return 4

    def test_shard_only(self):
        self._check_parity(spmd_mesh(dp_shard=2, tp=TP), DataParallelMeshDims(shard="dp_shard"))

    def test_replicate_only(self):
        """No sharding: placements stay as they were and gradients are all-reduced."""
        mesh = spmd_mesh(dp_replicate=2, tp=TP)
        self._check_parity(mesh, DataParallelMeshDims(replicate="dp_replicate"))

    def test_partial_grad_on_dp_dim_is_reduced_by_fsdp(self):
        """A gradient ``Partial`` on the shard dim is averaged by the reduce-scatter as is.

        Input batch-sharded over ``dp_shard``: each rank's local gradient is its partial
        sum and FSDP averages those, so the sharded gradient is the full gradient / 2.
        """
        mesh = spmd_mesh(dp_shard=2, tp=TP)
        linear = nn.Linear(DIM, DIM, bias=False)
        self.sync_module_states(linear)
        weight = linear.weight.detach().clone()
        linear.weight = nn.Parameter(distribute_tensor(weight, mesh, [Replicate(), Replicate()]))
        fully_shard(linear, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(0))
        out = linear(distribute_tensor(x, mesh, [Shard(0), Replicate()], src_data_rank=None))
        self.assertIsInstance(out.sum().placements[0], Partial)
        out.to_local().sum().backward()
        expected = x.sum(0).expand(DIM, DIM) / 2
        torch.testing.assert_close(linear.weight.grad.full_tensor(), expected)

    def test_errors(self):
        mesh = spmd_mesh(dp_shard=2, tp=TP)
        shard = DataParallelMeshDims(shard="dp_shard")

        def linear(placements=None) -> nn.Linear:
            module = nn.Linear(DIM, DIM, bias=False)
            if placements is not None:
                weight = distribute_tensor(module.weight.detach(), mesh, placements)
                module.weight = nn.Parameter(weight)
            return module

        replicated = [Replicate(), Replicate()]
        unnamed = DeviceMesh("cpu", mesh.mesh)
        cases = [
            (ValueError, "no dim names", dict(mesh=unnamed, dp_mesh_dims=shard)),
            (ValueError, "not dims of the mesh", dict(dp_mesh_dims=DataParallelMeshDims("dp"))),
            (
                ValueError,
                "in mesh order",
                dict(dp_mesh_dims=DataParallelMeshDims(("tp", "dp_shard"))),
            ),
            (
                ValueError,
                "both shard and replicate",
                dict(dp_mesh_dims=DataParallelMeshDims("tp", "tp")),
            ),
            (NotImplementedError, "int", dict(dp_mesh_dims=shard, reshard_after_forward=2)),
        ]
        for error, message, kwargs in cases:
            with self.subTest(message=message), self.assertRaisesRegex(error, message):
                fully_shard(linear(replicated), **{"mesh": mesh, **kwargs})
        with self.assertRaisesRegex(ValueError, "plain tensor"):
            fully_shard(linear(), mesh=mesh, dp_mesh_dims=shard)
        with self.assertRaisesRegex(ValueError, "Expected Replicate\\(\\) placement"):
            fully_shard(linear([Shard(0), Replicate()]), mesh=mesh, dp_mesh_dims=shard)
        other = spmd_mesh(dp_shard=2, other=TP)
        module = linear()
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), other, replicated))
        with self.assertRaisesRegex(ValueError, "not on the mesh passed"):
            fully_shard(module, mesh=mesh, dp_mesh_dims=shard)
        with self.assertRaisesRegex(ValueError, "at least one"):
            DataParallelMeshDims()


class TestDpMeshDims3D(DpMeshDimsMixin, FSDPTestMultiThread):
    """8 ranks: HSDP on ``(dp_replicate, dp_shard, tp)`` and several names for one role."""

    @property
    def world_size(self) -> int:
        return 8

    def test_hsdp(self):
        mesh = spmd_mesh(dp_replicate=2, dp_shard=2, tp=TP)
        dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
        self._check_parity(mesh, dims)

    def test_flattened_names(self):
        """``shard=("a", "b")`` shards over 4 ranks; ``replicate=("a", "b")`` replicates.

        One mesh for both: parameters must live on the very mesh object passed, and a DTensor
        wrapped in ``nn.Parameter`` may carry an earlier equal mesh (see [Note: SPMD meshes]).
        """
        mesh = spmd_mesh(a=2, b=2, tp=TP)
        self.run_subtests(
            {"role": ["shard", "replicate"]},
            lambda role: self._check_parity(mesh, DataParallelMeshDims(**{role: ("a", "b")})),
        )

    def test_flattened_uneven_not_implemented(self):
        """5 rows over a 2 x 2 shard mesh: nested chunking would differ from FSDP's."""
        mesh = spmd_mesh(a=2, b=2, tp=TP)
        module = nn.Linear(DIM, 5)
        for name in ("weight", "bias"):
            param = distribute_tensor(getattr(module, name).detach(), mesh, [Replicate()] * 3)
            module.register_parameter(name, nn.Parameter(param))
        with self.assertRaisesRegex(NotImplementedError, "split evenly"):
            fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("a", "b")))
