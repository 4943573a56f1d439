"""``fully_shard`` with ``MixedPrecisionPolicy`` trains like a DDP model that makes the same casts.

[Note: a fair mixed-precision reference]
FSDP computes with low-precision copies of the parameters and reduces gradients in fp32,
while the optimizer steps the fp32 shards. The reference, ``LowPrecisionCompute`` from
``reffsdp.testing.parity``, does exactly that without sharding: it runs the fp32 model
through ``functional_call`` with every parameter and the input cast to ``param_dtype``, so
autograd returns the low-precision gradient cast to fp32, which DDP then averages in fp32.
The two sides differ only in how the fp32 average is formed (DDP divides then sums, FSDP's
reduce-scatter averages), which over 2 or 4 ranks gives the same bits.
"""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from reffsdp import MixedPrecisionPolicy, fully_shard
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import LowPrecisionCompute, Passthrough, check_train_parity

pytestmark = pytest.mark.multithread


def _vectors(dim: int, batch: int = 2):
    return random_inputs(batch, dim)


class TestFullyShardMixedPrecision(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_train_parity(self):
        self.run_subtests(
            {
                "param_dtype": [torch.bfloat16, torch.float16],
                "output_dtype": [None, torch.float32],
            },
            self._test_train_parity,
        )

    def _test_train_parity(self, param_dtype: torch.dtype, output_dtype: torch.dtype | None):
        model = MLPStack(8)
        self.sync_module_states(model)
        ref_model = LowPrecisionCompute(copy.deepcopy(model), param_dtype, output_dtype)
        mp_policy = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=output_dtype
        )
        for block in model:
            fully_shard(block, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)

        seen = []  # (input dtype, weight dtype) as each block's forward sees them
        for block in model:
            block.register_forward_pre_hook(
                lambda module, args: seen.append((args[0].dtype, module.in_proj.weight.dtype))
            )
        with torch.no_grad():
            out = model(_vectors(8)(0, self.rank))
        self.assertEqual(out.dtype, output_dtype or param_dtype)
        self.assertEqual(seen, [(param_dtype, param_dtype)] * 3)  # the fp32 input was cast

        # No loosened tolerances: both sides make the same casts (see the module note) and
        # average over a power-of-two world size, where dividing is exact, so they agree to
        # fp32 rounding (bitwise, in practice). A low-precision rounding flipped by a tiny
        # fp32 difference would show as a mismatch far above any tolerance worth allowing.
        check_train_parity(self, ref_model, Passthrough(model), _vectors(8), num_steps=3)
        # The optimizer only ever saw the fp32 shards, and the gradients came back in fp32.
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
            self.assertEqual(param.dtype, torch.float32, name)
            self.assertEqual(param.to_local().dtype, torch.float32, name)
            self.assertEqual(param.grad.to_local().dtype, torch.float32, name)

    def test_cast_forward_inputs_false_leaves_inputs_alone(self):
        model = MLPStack(8)
        self.sync_module_states(model)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
        fully_shard(model, mp_policy=mp_policy)
        seen = []
        model.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        x = _vectors(8)(0, self.rank)
        with torch.no_grad():
            self.assertEqual(model(x.to(torch.bfloat16)).dtype, torch.bfloat16)
            with self.assertRaisesRegex(RuntimeError, "dtype"):  # fp32 input, bf16 weights
                model(x)
        self.assertEqual(seen, [torch.bfloat16, torch.float32])
        model.reset_iter_state()

    def test_reduce_dtype_only(self):
        # fp32 compute, reductions in fp32 too: reduce_dtype equal to the compute dtype is
        # dropped, and training is plain fp32 training.
        model = MLPStack(8)
        self.sync_module_states(model)
        ref_model = copy.deepcopy(model)
        mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for block in model:
            fully_shard(block, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        check_train_parity(self, ref_model, model, _vectors(8), num_steps=2)


class TestFullyShardMixedPrecisionWorldSize4(TestFullyShardMixedPrecision):
    @property
    def world_size(self) -> int:
        return 4
