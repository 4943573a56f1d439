"""What a user swapping imports relies on beyond training steps: parameter names and order,
``clip_grad_norm_`` on DTensor gradients, foreach optimizers, ``zero_grad(set_to_none=False)``
and no-grad evaluation between steps, all matching DDP."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from reffsdp import fully_shard
from reffsdp.testing import (
    MLP,
    FSDPTestMultiThread,
    MLPStack,
    check_train_parity,
    random_inputs,
    shard_bottom_up,
)
from reffsdp.testing.models import init_deterministic

pytestmark = pytest.mark.multithread


class TestFullyShardInterop(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_clip_grad_norm_zero_grad_and_eval_match_ddp(self):
        model = MLPStack(8)
        init_deterministic(model)  # same weights on every rank, no dead ReLUs
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        shard_bottom_up(model, model)
        self.assertEqual(
            [name for name, _ in model.named_parameters()],
            [name for name, _ in ddp.module.named_parameters()],
        )
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        ref_optim = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=True)
        make_inputs = random_inputs(4, 8)
        for step in range(3):
            x = make_inputs(step, self.rank)
            model(x).sum().backward()
            ddp(x).sum().backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            ref_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.5)
            self.assertGreater(ref_norm.item(), 0.5)  # clipping really happens
            torch.testing.assert_close(
                norm.full_tensor() if isinstance(norm, DTensor) else norm, ref_norm
            )
            optim.step()
            ref_optim.step()
            optim.zero_grad(set_to_none=False)
            ref_optim.zero_grad(set_to_none=False)
            with torch.no_grad():
                model.eval()
                ddp.eval()
                torch.testing.assert_close(model(x), ddp(x))
                model.train()
                ddp.train()
        for (name, param), ref_param in zip(model.named_parameters(), ddp.module.parameters()):
            torch.testing.assert_close(param.full_tensor(), ref_param, msg=name)

    def test_checkpoint_wrapper_blocks_match_ddp(self):
        """torch's ``apply_activation_checkpointing`` wrappers around sharded blocks."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        model = init_deterministic(MLPStack(8))
        ref_model = copy.deepcopy(model)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MLP))
        shard_bottom_up(model, model)
        check_train_parity(
            self,
            ref_model,
            model,
            random_inputs(4, 8),
            num_steps=3,
            prefixes_to_ignore=("_checkpoint_wrapped_module.",),
        )

    def test_replicate_leaves_sharded_children_to_fully_shard(self):
        """torch's composable ``replicate`` on a model whose child ``fully_shard`` sharded:
        ``replicate`` asks torch's composable-API registry which modules ``fully_shard``
        manages and leaves their parameters alone (a plain tensor in place of each DTensor
        would be a replacement of the wrong size); the rest it replicates, DDP-style."""
        from torch.distributed._composable import replicate

        model = init_deterministic(nn.Sequential(nn.Linear(8, 8), MLP(8), MLP(8)))
        ref_model = copy.deepcopy(model)
        fully_shard(model[1], reshard_after_forward=False)
        fully_shard(model[2])
        replicate(model)
        self.assertIsInstance(model[1].in_proj.weight, DTensor)
        self.assertNotIsInstance(model[0].weight, DTensor)
        check_train_parity(self, ref_model, model, random_inputs(4, 8), num_steps=3)
