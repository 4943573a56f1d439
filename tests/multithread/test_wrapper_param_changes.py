"""``FullyShardedDataParallel`` when the user changes parameters after wrapping.

Freezing parameters, moving the model to another dtype, assigning to an original
parameter's ``.data`` or replacing it, reading gradients inside ``no_sync()``: each is
checked against ``DistributedDataParallel`` (a copy changed the same way) and against
torch's own wrapper (``device_id=cpu``), which supports them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

from reffsdp import FullyShardedDataParallel, ShardingStrategy
from reffsdp.sharded_grad_scaler import ShardedGradScaler
from reffsdp.testing.build import reference_and_model, wrap_blocks
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPBlocks, init_deterministic
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity, sgd_with_momentum

pytestmark = pytest.mark.multithread

DIM = 5
make_inputs = random_inputs(3, DIM)
S = ShardingStrategy
STRATEGIES = [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD]


def blocks_model() -> MLPBlocks:
    return init_deterministic(MLPBlocks(DIM))


def torch_wrapped(model: nn.Module, strategy: ShardingStrategy, **kwargs) -> TorchFSDP:
    """``model`` wrapped by torch's wrapper, an instance per MLP block, on the CPU."""
    return TorchFSDP(
        model,
        auto_wrap_policy=TorchPolicy({MLP}),
        sharding_strategy=TorchStrategy[strategy.name],
        device_id=torch.device("cpu"),
        **kwargs,
    )


def full_params(wrapper_cls: type, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole, by its original name (clones)."""
    with wrapper_cls.summon_full_params(model):
        return {
            name.replace("_fsdp_wrapped_module.", ""): param.detach().clone()
            for name, param in model.named_parameters()
        }


def train(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    num_steps: int,
    scaler=None,
    *,
    dtype: torch.dtype = torch.float32,
    first_step: int = 0,
) -> None:
    for step in range(first_step, first_step + num_steps):
        optim.zero_grad()
        loss = model(make_inputs(step, torch.distributed.get_rank()).to(dtype)).sum()
        if scaler is None:
            loss.backward()
            optim.step()
            continue
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()


class TestFreezingAfterWrapping(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_frozen_block_stays_frozen_like_ddp_and_torch(self):
        """torch's test_freezing_weights(freeze_after_wrap_fsdp=True): ``requires_grad_(False)``
        on a wrapped block (its flat parameter, or its originals) after wrapping."""
        self.run_subtests(
            {"strategy": STRATEGIES, "use_orig_params": [False, True]}, self._check_frozen_block
        )

    def _check_frozen_block(self, strategy, use_orig_params):
        ref_model, model = reference_and_model(blocks_model())
        torch_model = torch_wrapped(copy.deepcopy(model), strategy, use_orig_params=use_orig_params)
        ref_model.layers[0].requires_grad_(False)
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        initial = full_params(FullyShardedDataParallel, wrapped)
        for module in (wrapped, torch_model):
            module.layers[0].requires_grad_(False)
        check_train_parity(self, ref_model, wrapped, make_inputs, num_steps=2)
        train(torch_model, sgd_with_momentum(torch_model.parameters()), 2)
        ours = full_params(FullyShardedDataParallel, wrapped)
        theirs = full_params(TorchFSDP, torch_model)
        for name, param in ours.items():
            torch.testing.assert_close(param, theirs[name], msg=name)
            frozen = name.startswith("layers.0.")
            self.assertEqual(torch.equal(param, initial[name]), frozen, name)

    def test_frozen_biases_in_one_flat_parameter_like_ddp(self):
        """torch's test_diff_trainability: biases frozen after wrapping with
        ``use_orig_params=True``, one flat parameter holding weights and biases, Adam."""
        self.run_subtests({"strategy": STRATEGIES}, self._check_frozen_biases)

    def _check_frozen_biases(self, strategy):
        ref_model, model = reference_and_model(blocks_model())
        for name, param in ref_model.named_parameters():
            param.requires_grad_("bias" not in name)
        wrapped = FullyShardedDataParallel(model, sharding_strategy=strategy, use_orig_params=True)
        self._assert_shard_holds_a_weight_and_a_bias(wrapped)
        for name, param in wrapped.named_parameters():
            param.requires_grad_("bias" not in name)
        check_train_parity(
            self,
            ref_model,
            wrapped,
            make_inputs,
            num_steps=3,
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-2),
        )

    def _assert_shard_holds_a_weight_and_a_bias(self, wrapped):
        held = [n for n, p in wrapped.named_parameters() if p.numel() > 0]
        self.assertTrue(any("bias" in n for n in held) and any("weight" in n for n in held))

    def test_frozen_biases_under_a_grad_scaler_like_ddp(self):
        """The same freezing, steps taken through ``ShardedGradScaler``; torch's wrapper and
        scaler land on DDP's parameters too."""
        ref_model, model = reference_and_model(blocks_model())
        torch_model = TorchFSDP(
            copy.deepcopy(model), use_orig_params=True, device_id=torch.device("cpu")
        )
        for name, param in ref_model.named_parameters():
            param.requires_grad_("bias" not in name)
        ddp = DDP(ref_model)
        wrapped = FullyShardedDataParallel(model, use_orig_params=True)
        for module in (wrapped, torch_model):
            for name, param in module.named_parameters():
                param.requires_grad_("bias" not in name)
        runs = [
            (ddp, torch.amp.GradScaler("cpu", init_scale=2.0**10)),
            (wrapped, ShardedGradScaler("cpu", init_scale=2.0**10)),
            (torch_model, TorchScaler("cpu", init_scale=2.0**10)),
        ]
        for module, scaler in runs:
            train(module, torch.optim.Adam(module.parameters(), lr=1e-2), 3, scaler)
        expected = {name: param.detach() for name, param in ref_model.named_parameters()}
        for wrapper_cls, module in ((FullyShardedDataParallel, wrapped), (TorchFSDP, torch_model)):
            for name, param in full_params(wrapper_cls, module).items():
                torch.testing.assert_close(param, expected[name], msg=f"{wrapper_cls}: {name}")


def data_parallel_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dtype) -> None:
    """One step of ``world_size`` ranks' data parallelism on one unsharded model: each
    rank's loss divided by the world size, so the gradient is the ranks' average."""
    world_size = torch.distributed.get_world_size()
    optim.zero_grad()
    for rank in range(world_size):
        (model(make_inputs(step, rank).to(dtype)).sum() / world_size).backward()
    optim.step()


class TestDtypeMovesAfterWrapping(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_half_or_double_before_the_first_forward_like_torch(self):
        """torch's test_basic_save_and_load_state_dict[fp16=True] calls ``model.half()`` on a
        wrapped model; the flat parameters take the new dtype, and an optimizer built before
        the move keeps training them."""
        self.run_subtests(
            {
                "dtype": [torch.float16, torch.float64],
                "use_orig_params": [False, True],
                "strategy": [S.FULL_SHARD, S.NO_SHARD],
            },
            self._check_move_before_forward,
        )

    def _check_move_before_forward(self, dtype, use_orig_params, strategy):
        _, model = reference_and_model(blocks_model())
        torch_model = torch_wrapped(copy.deepcopy(model), strategy, use_orig_params=use_orig_params)
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        for module in (wrapped, torch_model):
            optim = torch.optim.SGD(module.parameters(), lr=0.1)
            module.half() if dtype is torch.float16 else module.to(dtype)
            self.assertEqual({p.dtype for p in module.parameters()}, {dtype})
            train(module, optim, 2, dtype=dtype)
        theirs = full_params(TorchFSDP, torch_model)
        for name, param in full_params(FullyShardedDataParallel, wrapped).items():
            self.assertEqual(param.dtype, dtype, name)
            torch.testing.assert_close(param, theirs[name], msg=name)

    def test_double_after_training_like_data_parallel(self):
        """Between steps too (torch's wrapper fails there): the next forward computes in
        the new dtype and the optimizer steps the moved shards."""
        self.run_subtests(
            {"use_orig_params": [False, True], "strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP]},
            self._check_move_after_training,
        )

    def _check_move_after_training(self, use_orig_params, strategy):
        ref_model, model = reference_and_model(blocks_model())
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        optim = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for step, dtype in enumerate((torch.float32, torch.float64, torch.float64)):
            if step == 1:
                ref_model.to(dtype)
                wrapped.to(dtype)
            data_parallel_step(ref_model, ref_optim, step, dtype)
            train(wrapped, optim, 1, dtype=dtype, first_step=step)
        expected = dict(ref_model.named_parameters())
        for name, param in full_params(FullyShardedDataParallel, wrapped).items():
            self.assertEqual(param.dtype, torch.float64, name)
            torch.testing.assert_close(param, expected[name].detach(), msg=name)

    def test_moving_to_another_device_is_refused(self):
        """The shard's device is the constructor's to choose; a move elsewhere would leave
        the shard and the compute device apart."""
        wrapped = FullyShardedDataParallel(nn.Linear(4, 4), use_orig_params=True)
        with self.assertRaisesRegex(ValueError, r"FullyShardedDataParallel\(Linear\).*meta"):
            wrapped.to("meta")
