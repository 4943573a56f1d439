"""``FullyShardedDataParallel`` checkpoints through ``torch.distributed.checkpoint`` (DCP)
across world sizes, in real gloo processes.

Four ranks train and save a sharded model and optimizer state dict; two of them then load
it into models sharded over a two-rank group and train on. The reference is an unsharded
model that changed world size without a checkpoint (see ``test_fully_shard_checkpoint``).
"""

from __future__ import annotations

import copy
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp.api import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
from reffsdp.checkpoint import get_state_dict, set_state_dict
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.parity import local_data_parallel_step, train_step
from tests.multithread.test_fully_shard_checkpoint import shared_temp_dir
from tests.multithread.test_wrapper_state_dict import _blocks, adam, load, make_inputs, wrap

pytestmark = pytest.mark.multiprocess

SHARDED = StateDictType.SHARDED_STATE_DICT


def checkpoint_state(model: FSDP, optim: torch.optim.Optimizer, *configs) -> dict:
    """What a checkpoint holds: sharded model and optimizer state dicts."""
    with FSDP.state_dict_type(model, SHARDED, *configs):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (a zero step), so DCP has places to load."""
    lrs = [group["lr"] for group in optim.param_groups]
    for group in optim.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optim.step()
    optim.zero_grad(set_to_none=True)
    for group, lr in zip(optim.param_groups, lrs):
        group["lr"] = lr


def load_checkpoint(model, optim, path: str, group: dist.ProcessGroup, *configs) -> None:
    init_optim_state(optim)
    state = checkpoint_state(model, optim, *configs)
    dcp.load(state, checkpoint_id=path, process_group=group)
    load(model, optim, (state["model"], state["optim"]), SHARDED, *configs)


class TestWrapperCheckpointGloo(FSDPTest):
    @property
    def world_size(self) -> int:
        return 4

    def test_dcp_save_on_4_ranks_load_on_2(self):
        warnings.filterwarnings("ignore", category=FutureWarning)
        dtensors = (ShardedStateDictConfig(_use_dtensor=True), ShardedOptimStateDictConfig())
        pair = dist.new_group([0, 1])
        for use_orig_params, configs in ((False, ()), (True, dtensors)):
            self._check_dcp_4_to_2(use_orig_params, configs, pair)

    def test_get_state_dict_on_4_ranks_set_state_dict_on_2(self):
        """The same, through DCP's get_state_dict/set_state_dict as torch's wrapper's users
        call them (taken from reffsdp.checkpoint)."""
        pair = dist.new_group([0, 1])
        for use_orig_params in (False, True):
            self._check_dcp_4_to_2(use_orig_params, None, pair)

    def _check_dcp_4_to_2(self, use_orig_params: bool, configs: tuple | None, pair) -> None:
        """``configs``: the state-dict configs of FSDP's own functions; ``None``: DCP's
        get_state_dict/set_state_dict (reffsdp.checkpoint's)."""
        torch.manual_seed(0)
        initial = _blocks()  # the same in every rank process
        ref = copy.deepcopy(initial)
        ref_optim = adam(ref.parameters())
        for step in range(2):
            local_data_parallel_step(ref, ref_optim, make_inputs, step, 4)
        saved = copy.deepcopy(ref.state_dict())
        ref_losses = [
            local_data_parallel_step(ref, ref_optim, make_inputs, step, 2) for step in (2, 3)
        ]
        model = wrap(copy.deepcopy(initial), use_orig_params=use_orig_params)
        optim = adam(model.parameters())
        for step in range(2):
            train_step(model, optim, make_inputs(step, self.rank))
        path = shared_temp_dir()
        try:
            if configs is None:
                model_state, optim_state = get_state_dict(model, optim)
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
            else:
                dcp.save(checkpoint_state(model, optim, *configs), checkpoint_id=path)
            if self.rank >= 2:
                return
            other = wrap(_blocks(), process_group=pair, use_orig_params=use_orig_params)
            other_optim = adam(other.parameters())
            if configs is None:
                model_state, optim_state = get_state_dict(other, other_optim)
                state = {"model": model_state, "optim": optim_state}
                dcp.load(state, checkpoint_id=path, process_group=pair)
                set_state_dict(
                    other, other_optim, model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                )  # fmt: skip
            else:
                load_checkpoint(other, other_optim, path, pair, *configs)
            with FSDP.state_dict_type(other, StateDictType.FULL_STATE_DICT):
                for name, value in other.state_dict().items():
                    torch.testing.assert_close(value, saved[name], msg=name)
            for step, losses in zip((2, 3), ref_losses):
                loss = train_step(other, other_optim, make_inputs(step, self.rank))
                torch.testing.assert_close(loss, losses[self.rank])
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path)
