"""``torch.distributed.checkpoint.state_dict`` with ``FullyShardedDataParallel``.

A user who swapped torch's wrapper for reffsdp's takes DCP's ``get_state_dict`` /
``set_state_dict`` (and their model and optimizer halves) from ``reffsdp.checkpoint``, same
arguments: model and optimizer, full or sharded, on CPU or not, with ``use_orig_params``
either way, through ``dcp.save`` / ``dcp.load``. Every round trip must continue training bit
for bit; values and types are checked against an unsharded reference and torch's wrapper on
the same group. Outside those calls torch's module is as torch made it.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dcp_state_dict
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.tensor import DTensor

from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp.api import ShardingStrategy, StateDictType
from reffsdp.checkpoint import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    recognize_wrappers,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from reffsdp.core import comms
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import train_step
from tests.multithread.test_fully_shard_checkpoint import shared_temp_dir
from tests.multithread.test_wrapper_state_dict import (
    DIM,
    NextToTorchsWrapper,
    _blocks,
    _local_tensors,
    adam,
    full_values,
    make_inputs,
    trained,
    trained_next_to_torch,
    wrap,
)
from tests.multithread.test_wrapper_state_dict_models import (
    SharedModuleAndParameter,
    _blocks_checkpointed,
    tied_stack,
)

pytestmark = [pytest.mark.multithread, pytest.mark.filterwarnings("ignore::FutureWarning")]

TORCHS_STATE_GETTER = dcp_state_dict._get_module_fsdp_state_if_fully_sharded_module

FULL = StateDictOptions(full_state_dict=True)
SHARDED = StateDictOptions()
OPTIONS = {
    "full": FULL,
    "full_cpu_offload": StateDictOptions(full_state_dict=True, cpu_offload=True),
    "full_broadcast": StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    "sharded": SHARDED,
    "sharded_cpu_offload": StateDictOptions(cpu_offload=True),
}


def load(model, optim, model_state, optim_state, options: StateDictOptions) -> None:
    """``set_state_dict``; state dicts that only rank 0 holds need the two halves and
    ``broadcast_from_rank0`` (DCP's ``set_state_dict`` skips the model on ranks given an
    empty model state dict, for torch's wrapper too)."""
    if options.full_state_dict and options.cpu_offload:
        options = dataclasses.replace(options, broadcast_from_rank0=True)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optim, optim_state, options=options)
    else:
        set_state_dict(
            model, optim, model_state_dict=model_state, optim_state_dict=optim_state,
            options=options,
        )  # fmt: skip


class TestWrapperDCP(NextToTorchsWrapper):
    def _check_continues(self, model, optim, other, other_optim, where: str) -> None:
        for step in (2, 3):
            inputs = make_inputs(step, self.rank)
            loss = train_step(model, optim, inputs)
            self.assertEqual(train_step(other, other_optim, inputs), loss, where)
        expected = full_values(model)
        for name, value in full_values(other).items():
            self.assertTrue(torch.equal(value, expected[name]), f"{where}: {name}")

    def test_get_and_set_state_dict_round_trip(self):
        self.run_subtests(
            {"use_orig_params": [False, True], "options": list(OPTIONS)}, self._round_trip
        )

    def _round_trip(self, use_orig_params: bool, options: str) -> None:
        where = f"{options}, use_orig_params={use_orig_params}"
        opts = OPTIONS[options]
        ref, ref_optim, model, optim = trained(use_orig_params, self.world_size, steps=2)
        model_state, optim_state = get_state_dict(model, optim, options=opts)
        names = [name for name, _ in ref.named_parameters()]
        model_on_rank0_only = opts.full_state_dict and opts.cpu_offload
        optim_on_rank0_only = opts.full_state_dict and (
            opts.cpu_offload or opts.broadcast_from_rank0
        )
        if self.rank != 0 and model_on_rank0_only:
            self.assertEqual(model_state, {}, where)
        else:
            self.assertEqual(list(model_state), list(ref.state_dict()), where)
            for name, value in model_state.items():
                self.assertEqual(value.device.type, "cpu", where)
                sharded = not opts.full_state_dict and name in names
                self.assertIs(type(value), ShardedTensor if sharded else torch.Tensor, name)
                if not sharded:
                    torch.testing.assert_close(value, ref.state_dict()[name], msg=name)
        if self.rank != 0 and optim_on_rank0_only:
            self.assertFalse(optim_state.get("state"), where)
        else:
            self.assertEqual(sorted(optim_state["state"]), sorted(names), where)  # order: torch's
            self.assertEqual(optim_state["param_groups"][0]["params"], names, where)
            ref_state = ref_optim.state_dict()["state"]
            for index, name in enumerate(names):
                exp_avg = optim_state["state"][name]["exp_avg"]
                if opts.full_state_dict:
                    torch.testing.assert_close(exp_avg, ref_state[index]["exp_avg"], msg=name)
                else:
                    self.assertIsInstance(exp_avg, ShardedTensor, name)
        other = wrap(_blocks(), use_orig_params=use_orig_params)  # other weights
        other_optim = adam(other.parameters())  # no state yet: DCP gives it some
        load(other, other_optim, model_state, optim_state, opts)
        self._check_continues(model, optim, other, other_optim, where)

    def test_shared_parameters_round_trip(self):
        """Tied weights, a shared module and a parameter registered twice: DCP's state dicts
        load back (a sharded load failed on a tied weight's second name)."""
        self.run_subtests(
            {
                "factory": [tied_stack, SharedModuleAndParameter],
                "use_orig_params": [False, True],
                "options": ["full", "sharded"],
            },
            self._shared_round_trip,
        )

    def _shared_round_trip(self, factory, use_orig_params: bool, options: str) -> None:
        where = f"{factory.__name__}, {options}, use_orig_params={use_orig_params}"
        base = factory()
        self.sync_module_states(base)
        model = wrap(base, use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        train_step(model, optim, make_inputs(0, self.rank))
        model_state, optim_state = get_state_dict(model, optim, options=OPTIONS[options])
        other = wrap(factory(), use_orig_params=use_orig_params)  # other weights
        other_optim = adam(other.parameters())
        load(other, other_optim, model_state, optim_state, OPTIONS[options])
        self._check_continues(model, optim, other, other_optim, where)

    def test_checkpoint_wrappers_round_trip(self):
        """Checkpoint wrappers inside wrapped blocks, or put around every linear after
        wrapping: model and optimizer state under the unwrapped model's names, and a round
        trip through DCP continues training (the optimizer state was saved under names with
        '_checkpoint_wrapped_module.', and set_state_dict found none for the parameters)."""
        self.run_subtests(
            {"how": ["inside", "after"], "use_orig_params": [False, True]},
            self._checkpointed_round_trip,
        )

    def _checkpointed_round_trip(self, how: str, use_orig_params: bool) -> None:
        base = _blocks()
        self.sync_module_states(base)
        names = [name for name, _ in base.named_parameters()]
        model = _blocks_checkpointed(base, how, use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        train_step(model, optim, make_inputs(0, self.rank))
        for options in ("full", "sharded"):
            where = f"{how}, {options}, use_orig_params={use_orig_params}"
            model_state, optim_state = get_state_dict(model, optim, options=OPTIONS[options])
            self.assertEqual(list(model_state), list(base.state_dict()), where)
            self.assertEqual(sorted(optim_state["state"]), sorted(names), where)
            other = _blocks_checkpointed(_blocks(), how, use_orig_params=use_orig_params)
            other_optim = adam(other.parameters())
            load(other, other_optim, model_state, optim_state, OPTIONS[options])
            self._check_continues(model, optim, other, other_optim, where)

    def test_halves_and_sharded_optimizer_state_match_torch(self):
        """Names, types and this rank's values of DCP's state dicts match torch's wrapper."""
        for use_orig_params in (False, True):
            base = _blocks()
            self.sync_module_states(base)
            torch_model, torch_optim, model, optim = trained_next_to_torch(
                base, self.rank, use_orig_params
            )
            for options in (FULL, SHARDED):
                where = f"full={options.full_state_dict}, use_orig_params={use_orig_params}"
                state = get_model_state_dict(model, options=options)
                expected = get_model_state_dict(torch_model, options=options)
                self.assertEqual(list(state), list(expected), where)
                self._check_same(state, expected, where)
                optim_state = get_optimizer_state_dict(model, optim, options=options)
                expected = get_optimizer_state_dict(torch_model, torch_optim, options=options)
                self.assertEqual(list(optim_state["state"]), list(expected["state"]), where)
                self.assertEqual(optim_state["param_groups"], expected["param_groups"], where)
                for name, values in expected["state"].items():
                    self.assertEqual(list(optim_state["state"][name]), list(values), where)
                    self._check_same(optim_state["state"][name], values, f"{where}: {name}")

    def _check_same(self, state: dict, expected: dict, where: str) -> None:
        """Same types and, on this rank, same values."""
        for key, value in state.items():
            self.assertIs(type(value), type(expected[key]), f"{where}: {key}")
            if isinstance(value, torch.Tensor):
                for mine, theirs in zip(_local_tensors(value), _local_tensors(expected[key])):
                    torch.testing.assert_close(mine, theirs, msg=f"{where}: {key}")

    def test_dcp_save_and_load_continue_training(self):
        for use_orig_params in (False, True):
            _, _, model, optim = trained(use_orig_params, self.world_size, steps=2)
            model_state, optim_state = get_state_dict(model, optim)
            path = shared_temp_dir()
            try:
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
                other = wrap(_blocks(), use_orig_params=use_orig_params)
                other_optim = adam(other.parameters())
                other_model_state, other_optim_state = get_state_dict(other, other_optim)
                state = {"model": other_model_state, "optim": other_optim_state}
                dcp.load(state, checkpoint_id=path)
                set_state_dict(
                    other, other_optim, model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                )  # fmt: skip
            finally:
                dist.barrier()
                if self.rank == 0:
                    shutil.rmtree(path)
            self._check_continues(model, optim, other, other_optim, f"{use_orig_params=}")

    def test_state_dict_type_comes_back_after_dcp(self):
        _, _, model, optim = trained(False, self.world_size)
        FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
        get_state_dict(model, optim, options=FULL)
        self.assertIs(
            FSDP.get_state_dict_type(model).state_dict_type, StateDictType.LOCAL_STATE_DICT
        )

    def test_torch_and_reffsdp_wrappers_in_one_model_raise(self):
        torch_part = TorchFSDP(nn.Linear(4, 4), device_id=torch.device("cpu"))
        model = nn.Sequential(FSDP(nn.Linear(4, 4)), torch_part)
        with self.assertRaisesRegex(ValueError, "both torch's FullyShardedDataParallel and"):
            get_model_state_dict(model)

    def test_object_collectives_go_through_comms(self):
        """The optimizer state dict's object collectives are ``comms`` functions."""
        _, _, model, optim = trained(True, self.world_size)
        calls = []

        def record(kind):
            def call(*args, **kwargs):
                calls.append(kind)
                return comms._torch_collective(kind)(*args, **kwargs)

            return call

        gather, broadcast = comms.Collective.ALL_GATHER_OBJECT, comms.Collective.BROADCAST_OBJECT
        with comms.intercept(gather, record(gather)), comms.intercept(broadcast, record(broadcast)):
            state = get_optimizer_state_dict(model, optim, options=FULL)
            rank0_only = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_optimizer_state_dict(model, optim, state, options=rank0_only)
        self.assertIn(gather, calls)  # use_orig_params=True agrees on each state's names
        self.assertIn(broadcast, calls)  # rank 0's optimizer state dict

    def test_torchs_module_is_torchs_outside_the_calls(self):
        """Building wrappers changes nothing in DCP's module; the stand-ins are there while
        some rank is inside a call and gone once every rank's call has ended."""
        _, _, model, optim = trained(True, self.world_size)
        self.assertIs(dcp_state_dict.FSDP, TorchFSDP)
        self.assertIs(
            dcp_state_dict._get_module_fsdp_state_if_fully_sharded_module, TORCHS_STATE_GETTER
        )
        dist.barrier()  # no rank enters a call before every rank looked
        model_state, optim_state = get_state_dict(model, optim)
        set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)
        with recognize_wrappers():
            self.assertIsNot(dcp_state_dict.FSDP, TorchFSDP)
            self.assertIsInstance(model, dcp_state_dict.FSDP)
            self.assertEqual(list(dcp_state_dict.get_model_state_dict(model)), list(model_state))
        dist.barrier()  # every rank has left
        self.assertIs(dcp_state_dict.FSDP, TorchFSDP)
        self.assertIs(
            dcp_state_dict._get_module_fsdp_state_if_fully_sharded_module, TORCHS_STATE_GETTER
        )


class TestWrapperDCPHybrid(FSDPTestMultiThread):
    """HYBRID_SHARD on 2 replicas of 2 shards, given a 2-D device mesh (DTensors)."""

    @property
    def world_size(self) -> int:
        return 4

    def test_get_and_set_state_dict_round_trip(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        kwargs = dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
        for use_orig_params in (False, True):
            for name in ("full", "full_cpu_offload", "sharded"):
                where = f"{name}, use_orig_params={use_orig_params}"
                _, _, model, optim = trained(use_orig_params, 4, steps=2, **kwargs)
                model_state, optim_state = get_state_dict(model, optim, options=OPTIONS[name])
                if name == "sharded":
                    weight = model_state["layers.0.in_proj.weight"]
                    self.assertIsInstance(weight, DTensor, where)
                    self.assertEqual(weight.to_local().shape, (12, DIM), where)
                other = wrap(_blocks(), use_orig_params=use_orig_params, **kwargs)
                other_optim = adam(other.parameters())
                load(other, other_optim, model_state, optim_state, OPTIONS[name])
                TestWrapperDCP._check_continues(self, model, optim, other, other_optim, where)
