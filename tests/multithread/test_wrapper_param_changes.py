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


def train(model: nn.Module, optim: torch.optim.Optimizer, num_steps: int, scaler=None) -> None:
    for step in range(num_steps):
        optim.zero_grad()
        loss = model(make_inputs(step, torch.distributed.get_rank())).sum()
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
