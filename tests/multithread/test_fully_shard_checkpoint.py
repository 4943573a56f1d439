"""``fully_shard`` with ``torch.distributed.checkpoint``: state dicts, save, load, resharding.

The reference is one unsharded model trained on every rank's inputs at once: data
parallelism averages gradients over ranks, which is the gradient of the mean of the ranks'
losses. It needs no collectives, so it can follow a run that changes world size midway
(save on 4 ranks, load on 2) and tell whether training continued exactly.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.meshes import mesh_hsdp
from reffsdp.testing.models import MLPBlocks
from reffsdp.testing.multithread import FSDPTestMultiThread, run_threaded
from reffsdp.testing.parity import check_state_dict_parity, local_data_parallel_step, train_step

pytestmark = pytest.mark.multithread

DIM = 8
FULL = StateDictOptions(full_state_dict=True)


make_inputs = random_inputs(2, DIM)


def _blocks() -> MLPBlocks:
    return MLPBlocks(DIM, (3, 4), with_buffer=True)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-1, momentum=0.9)


def shard(model: MLPBlocks, mesh, **fsdp_kwargs) -> MLPBlocks:
    return shard_bottom_up(model, model.layers, mesh=mesh, **fsdp_kwargs)


def train_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """What a training checkpoint holds: the model's and the optimizer's state dicts."""
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
    }


def load_train_state(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Load the :func:`train_state` saved at ``path`` into ``model`` and ``optim``."""
    state = train_state(model, optim)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])


def shared_temp_dir() -> str:
    """A directory rank 0 creates and every rank of the default group receives."""
    path = [tempfile.mkdtemp(prefix="reffsdp-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


class TestStateDicts(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _ref_and_model(self, mesh=None, **fsdp_kwargs) -> tuple[MLPBlocks, MLPBlocks]:
        ref, model = reference_and_model(_blocks())
        mesh = mesh or init_device_mesh("cpu", (self.world_size,))
        return ref, shard(model, mesh, **fsdp_kwargs)

    def _check_training_continues(self, ref, ref_optim, model, optim, steps) -> None:
        """Train ``model`` and the reference on: same losses each step, same weights after."""
        for step in steps:
            ref_losses = local_data_parallel_step(
                ref, ref_optim, make_inputs, step, self.world_size
            )
            self.assertAlmostEqual(
                train_step(model, optim, make_inputs(step, self.rank)), ref_losses[self.rank], 5
            )
        check_state_dict_parity(self, ref, model)

    def test_model_state_dict_sharded_and_full(self):
        ref, model = self._ref_and_model()
        ref_optim, optim = sgd(ref.parameters()), sgd(model.parameters())
        local_data_parallel_step(ref, ref_optim, make_inputs, 0, self.world_size)
        train_step(model, optim, make_inputs(0, self.rank))

        sharded = get_model_state_dict(model)
        self.assertEqual(list(sharded), list(ref.state_dict()))
        for name, value in sharded.items():
            if name.endswith(".buffer"):
                self.assertNotIsInstance(value, DTensor)
                continue
            self.assertIsInstance(value, DTensor, name)
            self.assertEqual(value.placements, (Shard(0),), name)
        full = get_model_state_dict(model, options=FULL)
        for name, value in full.items():
            self.assertNotIsInstance(value, DTensor, name)
            torch.testing.assert_close(value, ref.state_dict()[name], msg=name)

        # Load new full values: each rank keeps its own rows.
        new_full = {name: value + 1 for name, value in full.items()}
        set_model_state_dict(model, new_full, options=FULL)
        with torch.no_grad():
            for tensor in ref.state_dict().values():
                tensor.add_(1)
        check_state_dict_parity(self, ref, model)

        # A sharded state dict loads into a differently initialized sharded model.
        _, other = self._ref_and_model()
        set_model_state_dict(other, get_model_state_dict(model))
        check_state_dict_parity(self, ref, other)
        # ... and both keep training like the reference.
        ref_optim, optim, other_optim = sgd(ref.parameters()), sgd(model.parameters()), None
        other_optim = sgd(other.parameters())
        for step in (1, 2):
            ref_losses = local_data_parallel_step(
                ref, ref_optim, make_inputs, step, self.world_size
            )
            self.assertAlmostEqual(
                train_step(model, optim, make_inputs(step, self.rank)), ref_losses[self.rank], 5
            )
            self.assertAlmostEqual(
                train_step(other, other_optim, make_inputs(step, self.rank)),
                ref_losses[self.rank],
                5,
            )
        check_state_dict_parity(self, ref, model)
        check_state_dict_parity(self, ref, other)

    def test_state_dict_between_forward_and_backward_is_sharded(self):
        """With ``reshard_after_forward=False`` the forward leaves unsharded parameters
        registered; saving still sees the sharded DTensors, and backward still works."""
        ref, model = self._ref_and_model(reshard_after_forward=False)
        loss = model(make_inputs(0, self.rank)).sum()
        self.assertNotIsInstance(model.proj.weight, DTensor)  # unsharded while in flight
        state = get_model_state_dict(model)
        for name, value in state.items():
            if not name.endswith(".buffer"):
                self.assertIsInstance(value, DTensor, name)
                self.assertEqual(value.placements, (Shard(0),), name)
                torch.testing.assert_close(value.full_tensor(), ref.state_dict()[name])
        loss.backward()
        ref_loss = sum(ref(make_inputs(0, r)).sum() for r in range(self.world_size))
        (ref_loss / self.world_size).backward()
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, msg=name)

    def test_full_state_dict_broadcast_from_rank0(self):
        ref, model = self._ref_and_model()
        with torch.no_grad():
            for tensor in ref.state_dict().values():
                tensor.mul_(2)
        state = ref.state_dict() if self.rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state, options=options)
        check_state_dict_parity(self, ref, model)

    def test_optimizer_state_dict(self):
        ref, model = self._ref_and_model()
        adam = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
        ref_optim, optim = adam(ref.parameters()), adam(model.parameters())
        for step in range(2):
            local_data_parallel_step(ref, ref_optim, make_inputs, step, self.world_size)
            train_step(model, optim, make_inputs(step, self.rank))
        ref_state = ref_optim.state_dict()["state"]
        names = [name for name, _ in ref.named_parameters()]

        sharded = get_optimizer_state_dict(model, optim)
        self.assertEqual(sorted(sharded["state"]), sorted(names))
        for name, state in sharded["state"].items():
            self.assertIsInstance(state["exp_avg"], DTensor, name)
            self.assertEqual(state["exp_avg"].placements, (Shard(0),), name)
        full = get_optimizer_state_dict(model, optim, options=FULL)
        for index, name in enumerate(names):
            for key in ("exp_avg", "exp_avg_sq"):
                value = full["state"][name][key]
                self.assertNotIsInstance(value, DTensor)
                torch.testing.assert_close(value, ref_state[index][key], msg=f"{name} {key}")
            self.assertEqual(float(full["state"][name]["step"]), 2.0)

        # Restore model and optimizer into fresh ones; training continues identically.
        _, other = self._ref_and_model()
        other_optim = adam(other.parameters())
        set_model_state_dict(other, get_model_state_dict(model))
        set_optimizer_state_dict(other, other_optim, sharded)
        self._check_training_continues(ref, ref_optim, other, other_optim, steps=(2, 3))

    def test_dcp_save_load_round_trip(self):
        ref, model = self._ref_and_model()
        ref_optim, optim = sgd(ref.parameters()), sgd(model.parameters())
        local_data_parallel_step(ref, ref_optim, make_inputs, 0, self.world_size)
        train_step(model, optim, make_inputs(0, self.rank))
        path = shared_temp_dir()
        try:
            dcp.save(train_state(model, optim), checkpoint_id=path)
            _, other = self._ref_and_model()
            other_optim = sgd(other.parameters())
            load_train_state(other, other_optim, path)
            check_state_dict_parity(self, ref, other)
            self._check_training_continues(ref, ref_optim, other, other_optim, steps=(1, 2))
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path)


class TestHSDPStateDict(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_hsdp_state_dicts(self):
        ref, model = reference_and_model(_blocks())
        shard(model, mesh_hsdp(2, 2))
        for name, value in get_model_state_dict(model).items():
            if isinstance(value, DTensor):
                self.assertEqual(value.placements, (Replicate(), Shard(0)), name)
        full = get_model_state_dict(model, options=FULL)
        for name, value in full.items():
            torch.testing.assert_close(value, ref.state_dict()[name], msg=name)


# -- resharding: save on one world size / mesh, load on another ----------------------------


@pytest.mark.parametrize("save_mesh", ["1d", "hsdp"])
def test_save_on_4_ranks_load_on_2(save_mesh, tmp_path):
    """Save after 2 steps on 4 ranks (FSDP or 2x2 HSDP), load on 2 ranks, train 2 more.

    The continued run must match a reference that never checkpointed: 2 steps averaging
    over 4 ranks' inputs, then 2 averaging over 2 ranks'. Momentum buffers are part of the
    optimizer state, so a lost or misplaced buffer changes the parameters.
    """
    torch.manual_seed(0)
    initial, unrelated = _blocks(), _blocks()  # built here: rank threads share the RNG
    ref = copy.deepcopy(initial)
    ref_optim = sgd(ref.parameters())
    for step in range(2):
        local_data_parallel_step(ref, ref_optim, make_inputs, step, 4)
    saved = copy.deepcopy(ref.state_dict())
    ref_losses = [local_data_parallel_step(ref, ref_optim, make_inputs, step, 2) for step in (2, 3)]
    path = str(tmp_path / "checkpoint")

    def save(rank: int) -> None:
        if save_mesh == "1d":
            mesh = init_device_mesh("cpu", (4,))
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        model = shard(copy.deepcopy(initial), mesh)
        optim = sgd(model.parameters())
        for step in range(2):
            train_step(model, optim, make_inputs(step, rank))
        dcp.save(train_state(model, optim), checkpoint_id=path)

    def load_and_train(rank: int) -> None:
        model = shard(copy.deepcopy(unrelated), init_device_mesh("cpu", (2,)))
        optim = sgd(model.parameters())
        load_train_state(model, optim, path)
        for name, value in get_model_state_dict(model, options=FULL).items():
            torch.testing.assert_close(value, saved[name], msg=name)
        for step, losses in zip((2, 3), ref_losses):
            torch.testing.assert_close(
                train_step(model, optim, make_inputs(step, rank)), losses[rank]
            )
        check_state_dict_parity(None, ref, model)

    run_threaded(save, 4)
    assert sorted(f for f in os.listdir(path) if f.endswith(".distcp")) == [
        f"__{rank}_0.distcp" for rank in range(4)
    ]
    run_threaded(load_and_train, 2)


def test_tensor_parallel_save_loads_into_1d(tmp_path):
    """FSDP + TP (dp 2 x tp 2, strided sharding) saves; a 1D FSDP model on 2 ranks loads."""
    torch.manual_seed(0)
    saved, unrelated = (
        _blocks(),
        _blocks(),
    )
    path = str(tmp_path / "checkpoint")
    plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}

    def save(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model = copy.deepcopy(saved)
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        shard(model, mesh["dp_shard"])
        dcp.save(get_model_state_dict(model), checkpoint_id=path)

    def load(rank: int) -> None:
        model = shard(copy.deepcopy(unrelated), init_device_mesh("cpu", (2,)))
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
        check_state_dict_parity(None, saved, model)

    run_threaded(save, 4)
    run_threaded(load, 2)
