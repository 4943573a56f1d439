"""``fully_shard`` trains like DDP over real gloo processes.

The threaded tests (``tests/multithread/test_fully_shard_*.py``) cover every feature; this
file repeats the main ones where collectives run on gloo, which unlike the threaded group
has no ``PREMUL_SUM`` (custom divide factors fall back to a sum and a division) and runs
collectives on its own threads. Each method groups several configurations, since every
test spawns its rank processes.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from reffsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from reffsdp.core import comms
from reffsdp.core.comms import ReduceOp
from reffsdp.testing.inputs import random_inputs, random_tokens
from reffsdp.testing.models import DoubleLinear, MLPStack, ModelArgs, Transformer
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.parity import (
    LowPrecisionCompute,
    Passthrough,
    broadcast_params_from_rank0,
    check_train_parity,
)
from reffsdp.testing.patching import patch_reduce_scatter

pytestmark = pytest.mark.multiprocess


def _vectors(dim: int, batch: int = 2):
    return random_inputs(batch, dim)


_tokens = random_tokens(8, 2, 8)


def _synced(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(reference, model)``: rank 0's weights on every rank, and a copy to shard."""
    broadcast_params_from_rank0(model)
    return copy.deepcopy(model), model


def _shard_blocks(model: nn.Module, blocks, **kwargs) -> None:
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class TestFullyShardGlooTraining(FSDPTest):
    @property
    def world_size(self) -> int:
        return 4  # ranks that own no rows, and reshard_after_forward=2

    def test_train_parity(self):
        self.run_subtests(
            {"model_name": ["reshard_to_2", "uneven", "shard_dim_1", "transformer"]},
            self._test_train_parity,
        )

    def _test_train_parity(self, model_name: str):
        loss_fn = None
        make_inputs = _vectors(8)
        if model_name == "transformer":  # tied weights and activation checkpointing
            args = ModelArgs(dim=8, n_heads=2, weight_tying=True, checkpoint_activations=True)
            ref_model, model = _synced(Transformer(args))
            _shard_blocks(model, model.layers)
            make_inputs, loss_fn = _tokens, lambda logits: logits.logsumexp(-1).sum()
        elif model_name == "uneven":  # 15- and 5-row weights, and a 1-row head
            ref_model, model = _synced(nn.Sequential(*MLPStack(5), nn.Linear(5, 1)))
            _shard_blocks(model, model[:3], reshard_after_forward=False)
            make_inputs = _vectors(5)
        elif model_name == "shard_dim_1":
            ref_model, model = _synced(MLPStack(8))
            placement_fn = lambda p: Shard(1) if p.dim() == 2 else None  # noqa: E731
            _shard_blocks(model, model, shard_placement_fn=placement_fn)
        else:
            ref_model, model = _synced(MLPStack(8))
            _shard_blocks(model, model, reshard_after_forward=2)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
        check_train_parity(self, ref_model, model, make_inputs, num_steps=2, loss_fn=loss_fn)


class TestFullyShardGloo(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_gradient_reduction(self):
        self.run_subtests(
            {
                "setting": [
                    "divide_by_world_size",
                    "divide_by_three",
                    "force_sum",
                    "all_reduce_hook",
                    "unused_param",
                    "bf16_params_fp32_reduce",
                ]
            },
            self._test_gradient_reduction,
        )

    def _test_gradient_reduction(self, setting: str):
        if setting == "bf16_params_fp32_reduce":
            ref_model, model = _synced(MLPStack(8))
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            _shard_blocks(model, model, mp_policy=mp_policy)
            # Same casts on both sides, so fp32 tolerances hold (see the threaded twin).
            check_train_parity(
                self,
                LowPrecisionCompute(ref_model, torch.bfloat16),
                Passthrough(model),
                _vectors(8),
                num_steps=2,
            )
            return
        if setting == "unused_param":  # lin2 runs on rank 0 only
            ref_model, model = _synced(DoubleLinear(8))
            fully_shard(model)
            model.set_reduce_scatter_unused_params(True)
            for m in (ref_model, model):
                m.use_second_linear = self.rank == 0
            check_train_parity(
                self,
                ref_model,
                model,
                _vectors(8),
                num_steps=2,
                ddp_kwargs={"find_unused_parameters": True},
            )
            return
        ref_model, model = _synced(MLPStack(8))
        _shard_blocks(model, model)
        scale = 1.0  # sharded grads relative to DDP's averaged ones
        ops = []
        for module in _fsdp_modules(model):
            if setting == "divide_by_world_size":
                module.set_gradient_divide_factor(float(self.world_size))
            elif setting == "divide_by_three":  # gloo has no PREMUL_SUM: sum, then divide
                module.set_gradient_divide_factor(3.0)
                scale = self.world_size / 3.0
            elif setting == "force_sum":
                module.set_force_sum_reduction_for_comms(True)
            else:
                module.set_all_reduce_hook(lambda reduced: reduced.mul_(2))
                scale = 2.0

        def recording(output, input, op=ReduceOp.SUM, group=None, async_op=False):
            ops.append(op)
            return comms.torch_reduce_scatter()(
                output, input, op=op, group=group, async_op=async_op
            )

        ddp_model = DistributedDataParallel(ref_model)
        with patch_reduce_scatter(recording):
            for iteration in range(2):  # the second backward accumulates into the first
                inputs = _vectors(8)(iteration, self.rank)
                ddp_model(inputs).sum().backward()
                model(inputs).sum().backward()
                for name, param in model.named_parameters():
                    expected = distribute_tensor(
                        ref_model.get_parameter(name).grad * scale,
                        param.device_mesh,
                        param.placements,
                        src_data_rank=None,
                    ).to_local()
                    torch.testing.assert_close(param.grad.to_local(), expected, msg=name)
        expected_op = (
            ReduceOp.AVG if setting in ("divide_by_world_size", "all_reduce_hook") else ReduceOp.SUM
        )
        self.assertEqual(ops, [expected_op] * 2 * 3)  # two backwards, three groups

    def test_accumulation_and_state_dict(self):
        self.run_subtests(
            {"setting": ["no_sync", "sync_each_microbatch", "load_state_dict", "meta_init"]},
            self._test_accumulation_and_state_dict,
        )

    def _test_accumulation_and_state_dict(self, setting: str):
        ref_model, model = _synced(MLPStack(8))
        if setting == "meta_init":
            with torch.device("meta"):
                model = MLPStack(8)
        elif setting == "load_state_dict":
            model = MLPStack(8)  # other weights on each rank, until the load below
        _shard_blocks(model, model)
        if setting == "meta_init":
            model.to_empty(device="cpu")
        if setting in ("meta_init", "load_state_dict"):
            model.load_state_dict(
                {
                    name: distribute_tensor(
                        value, param.device_mesh, param.placements, src_data_rank=None
                    )
                    for (name, value), param in zip(
                        ref_model.named_parameters(), model.parameters()
                    )
                }
            )

        @contextlib.contextmanager
        def no_sync(module: FSDPModule):
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
                module.set_reshard_after_backward(True)

        accumulate = setting in ("no_sync", "sync_each_microbatch")
        check_train_parity(
            self,
            ref_model,
            model,
            _vectors(8),
            num_steps=2,
            num_microbatches=2 if accumulate else 1,
            no_sync=no_sync if setting == "no_sync" else None,
        )
        state_dict = model.state_dict()
        for name, _ in model.named_parameters():
            self.assertIsInstance(state_dict[name], DTensor, name)
            torch.testing.assert_close(
                state_dict[name].full_tensor(), ref_model.get_parameter(name).detach()
            )
