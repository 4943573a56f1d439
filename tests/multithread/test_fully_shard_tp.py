"""``fully_shard`` over tensor-parallel DTensor parameters (2D FSDP + TP, 3D HSDP + TP).

Each :class:`MLP` block of an :class:`MLPStack` is parallelized with ``in_proj`` column-wise
and ``out_proj`` row-wise over the ``tp`` mesh dim, then ``fully_shard``-ed over the
data-parallel dims. FSDP shards each rank's local TP shard again (SPEC 2.3), so the sharded
parameters live on the joined ``(dp..., tp)`` mesh. Ranks of one TP group compute one
replica of the model, so they get the same inputs (keyed by ``rank // tp``); the DDP
reference over all ranks then averages exactly what FSDP + TP averages.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from reffsdp import MixedPrecisionPolicy, fully_shard
from reffsdp.core import compat
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.meshes import mesh_dp_tp, mesh_nd
from reffsdp.testing.models import MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity

pytestmark = pytest.mark.multithread

DIM = 8
TP = 2
TP_PLAN = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}


# Same inputs on the ranks of one TP group, different across TP groups.
make_inputs = random_inputs(2, DIM, same_within=TP)


def parallelize(model: MLPStack, tp_mesh: DeviceMesh) -> MLPStack:
    for block in model:
        parallelize_module(block, tp_mesh, TP_PLAN)
    return model


def tp_and_shard(model: MLPStack, mesh: DeviceMesh, **fsdp_kwargs) -> MLPStack:
    """TP over ``mesh["tp"]``, then ``fully_shard`` over the other (data-parallel) dims."""
    dp_names = tuple(name for name in mesh.mesh_dim_names if name != "tp")
    parallelize(model, mesh["tp"])
    return shard_bottom_up(model, model, mesh=mesh[dp_names], **fsdp_kwargs)


def expected_placements(dp: tuple, name: str) -> tuple:
    """SPEC 2.3 placements of a sharded TP parameter; ``dp`` precedes the FSDP placement."""
    leaf = name.rsplit(".", 2)[-2:]
    if leaf[0] == "in_proj":  # colwise: weight and bias TP-sharded on dim 0
        return (*dp, _StridedShard(0, split_factor=TP), Shard(0))
    if leaf[1] == "weight":  # rowwise weight: TP-sharded on dim 1
        return (*dp, Shard(0), Shard(1))
    return (*dp, Shard(0), Replicate())  # rowwise bias: replicated over TP


class NDTestMixin:
    def _ref_and_model(self) -> tuple[nn.Module, MLPStack]:
        return reference_and_model(MLPStack(DIM))

    def _check_full_tensors(self, model: nn.Module, ref: nn.Module, *, grads: bool) -> None:
        for (name, param), (ref_name, ref_param) in zip(
            model.named_parameters(), ref.named_parameters()
        ):
            self.assertEqual(name, ref_name)
            full = param.full_tensor()
            ref_full = ref_param.full_tensor() if isinstance(ref_param, DTensor) else ref_param
            torch.testing.assert_close(full, ref_full.detach(), msg=name)
            if grads:
                ref_grad = ref_param.grad
                ref_grad = ref_grad.full_tensor() if isinstance(ref_grad, DTensor) else ref_grad
                torch.testing.assert_close(param.grad.full_tensor(), ref_grad, msg=name)

    def _check_parity(self, mesh: DeviceMesh, dp: tuple) -> None:
        ref, model = self._ref_and_model()
        tp_and_shard(model, mesh)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
            self.assertEqual(param.placements, expected_placements(dp, name), name)
            self.assertEqual(param.device_mesh.mesh_dim_names, mesh.mesh_dim_names, name)
        self._check_full_tensors(model, ref, grads=False)
        check_train_parity(self, ref, model, make_inputs, num_steps=2)
        self._check_full_tensors(model, ref.module if hasattr(ref, "module") else ref, grads=True)

    def _check_mixed_precision(self, mesh: DeviceMesh) -> None:
        """bf16 compute and fp32 reduction against TP without FSDP, with the same casts.

        The reference is the same TP model (on its own mesh of the same shape); each step it
        computes in a bf16 copy, up-casts the gradients' local tensors, averages them in fp32
        over the data-parallel ranks and steps its fp32 parameters. The forward then runs the
        very same bf16 TP computation as FSDP's, so losses match exactly.
        """
        ref, model = self._ref_and_model()
        dp_size = mesh.size() // TP
        ref_mesh = init_device_mesh("cpu", (dp_size, TP), mesh_dim_names=("dp", "tp"))
        parallelize(ref, ref_mesh["tp"])
        dp_group = ref_mesh.get_group("dp")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        tp_and_shard(model, mesh, mp_policy=policy)
        optim = torch.optim.SGD(model.parameters(), lr=1e-1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=1e-1)
        for step in range(2):
            x = make_inputs(step, self.rank)
            compute = copy.deepcopy(ref).to(torch.bfloat16)
            ref_loss = compute(x.to(torch.bfloat16)).float().sum()
            ref_loss.backward()
            for param, compute_param in zip(ref.parameters(), compute.parameters()):
                grad = compute_param.grad.redistribute(placements=param.placements).float()
                dist.all_reduce(grad.to_local(), op=dist.ReduceOp.AVG, group=dp_group)
                param.grad = grad
            loss = model(x).float().sum()
            loss.backward()
            torch.testing.assert_close(loss, ref_loss)
            for name, param in model.named_parameters():
                self.assertEqual(param.to_local().dtype, torch.float32, name)
                self.assertEqual(param.grad.to_local().dtype, torch.float32, name)
            self._check_full_tensors(model, ref, grads=True)
            optim.step()
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
            self._check_full_tensors(model, ref, grads=False)


class TestFullyShardTP2D(NDTestMixin, FSDPTestMultiThread):
    """dp = 2, tp = 2 on 4 ranks."""

    @property
    def world_size(self) -> int:
        return 4

    def test_train_parity_and_placements(self):
        self._check_parity(mesh_dp_tp(2, TP), dp=())

    def test_mixed_precision(self):
        self._check_mixed_precision(mesh_dp_tp(2, TP))

    def test_dtensor_on_mesh_of_another_device_type(self):
        """TP DTensors on a ``cuda`` or ``meta`` mesh cannot be sharded over a ``cpu`` mesh.

        From torch 2.14, ``nn.Parameter`` of a DTensor on a ``meta`` mesh fails in DTensor
        itself (it asks the meta device for a device count), so only ``cuda`` is tried there.
        """
        device_types = ["cuda", "meta"] if compat.TORCH_VERSION < (2, 14) else ["cuda"]
        self.run_subtests({"device_type": device_types}, self._check_device_mismatch)

    def _check_device_mismatch(self, device_type: str) -> None:
        mesh = mesh_dp_tp(2, TP)
        other_tp_mesh = DeviceMesh(device_type, mesh["tp"].mesh, mesh_dim_names=("tp",))
        linear = nn.Linear(DIM, DIM)
        local = linear.weight.detach()[: DIM // TP]
        # from_local would move the local tensor to the mesh's device, which this machine may
        # lack (or, for meta from torch 2.14, ask it for a device count); FSDP only reads the
        # DTensor's mesh before refusing it.
        meta = TensorMeta(linear.weight.shape, linear.weight.stride(), local.dtype)
        spec = DTensorSpec(other_tp_mesh, (Shard(0),), meta)
        weight = DTensor(local, spec, requires_grad=True)
        linear.weight = nn.Parameter(weight)
        with self.assertRaisesRegex(ValueError, f"{device_type} mesh"):
            fully_shard(linear, mesh=mesh["dp_shard"])


class TestFullyShardND(NDTestMixin, FSDPTestMultiThread):
    """8 ranks: 2D (dp = 4, tp = 2) and 3D (replicate 2, shard 2, tp 2)."""

    @property
    def world_size(self) -> int:
        return 8

    def test_train_parity_and_placements(self):
        self.run_subtests({"dims": ["2d", "3d"]}, self._check_dims)

    def _check_dims(self, dims: str) -> None:
        if dims == "2d":
            self._check_parity(mesh_dp_tp(4, TP), dp=())
        else:
            self._check_parity(mesh_nd(2, 2, TP), dp=(Replicate(),))

    def test_mixed_precision_3d(self):
        self._check_mixed_precision(mesh_nd(2, 2, TP))

    def test_int_reshard_after_forward_not_implemented(self):
        _, model = self._ref_and_model()
        tp_and_shard(model, mesh_dp_tp(4, TP), reshard_after_forward=2)
        with self.assertRaises(NotImplementedError):
            model(make_inputs(0, self.rank))
