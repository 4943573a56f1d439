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
from torch import nn
from torch.distributed.tensor import DTensor

from reffsdp import MixedPrecisionPolicy, fully_shard
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import LowPrecisionCompute, Passthrough, check_train_parity

pytestmark = pytest.mark.multithread


make_inputs = random_inputs(2, 8)


class MixedPrecisionChecks:
    """A test body that the gloo suite runs too (``tests/multiprocess/test_fully_shard_gloo.py``,
    in one test with others, since each of its tests pays for starting the rank processes)."""

    def check_mixed_precision_parity(
        self, param_dtype: torch.dtype, output_dtype: torch.dtype | None
    ):
        ref_model, model = reference_and_model(MLPStack(8))
        ref_model = LowPrecisionCompute(ref_model, param_dtype, output_dtype)
        mp_policy = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=output_dtype
        )
        shard_bottom_up(model, model, mp_policy=mp_policy)

        seen = []  # (input dtype, weight dtype) as each block's forward sees them
        for block in model:
            block.register_forward_pre_hook(
                lambda module, args: seen.append((args[0].dtype, module.in_proj.weight.dtype))
            )
        with torch.no_grad():
            out = model(make_inputs(0, self.rank))
        self.assertEqual(out.dtype, output_dtype or param_dtype)
        self.assertEqual(seen, [(param_dtype, param_dtype)] * 3)  # the fp32 input was cast

        # No loosened tolerances: both sides make the same casts (see the module note) and
        # average over a power-of-two world size, where dividing is exact, so they agree to
        # fp32 rounding (bitwise, in practice). A low-precision rounding flipped by a tiny
        # fp32 difference would show as a mismatch far above any tolerance worth allowing.
        check_train_parity(self, ref_model, Passthrough(model), make_inputs, num_steps=3)
        # The optimizer only ever saw the fp32 shards, and the gradients came back in fp32.
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
            self.assertEqual(param.dtype, torch.float32, name)
            self.assertEqual(param.to_local().dtype, torch.float32, name)
            self.assertEqual(param.grad.to_local().dtype, torch.float32, name)


class TestFullyShardMixedPrecision(MixedPrecisionChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_train_parity(self):
        self.run_subtests(
            {
                "param_dtype": [torch.bfloat16, torch.float16],
                "output_dtype": [None, torch.float32],
            },
            self.check_mixed_precision_parity,
        )

    def test_cast_forward_inputs_false_leaves_inputs_alone(self):
        _, model = reference_and_model(MLPStack(8))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
        fully_shard(model, mp_policy=mp_policy)
        seen = []
        model.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        x = make_inputs(0, self.rank)
        with torch.no_grad():
            self.assertEqual(model(x.to(torch.bfloat16)).dtype, torch.bfloat16)
            with self.assertRaisesRegex(RuntimeError, "dtype"):  # fp32 input, bf16 weights
                model(x)
        self.assertEqual(seen, [torch.bfloat16, torch.float32])
        model.reset_iter_state()

    def test_reduce_dtype_only(self):
        # fp32 compute, reductions in fp32 too: reduce_dtype equal to the compute dtype is
        # dropped, and training is plain fp32 training.
        ref_model, model = reference_and_model(MLPStack(8))
        shard_bottom_up(model, model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        check_train_parity(self, ref_model, model, make_inputs, num_steps=2)


class TestFullyShardMixedPrecisionWorldSize4(TestFullyShardMixedPrecision):
    @property
    def world_size(self) -> int:
        return 4

    def test_full_precision_window_between_forward_and_backward(self):
        """``ParamGroup.unsharded_in_full_precision`` (behind the wrapper's
        ``summon_full_params``) on ``ShardedParam`` members: the full fp32 values are shown,
        and the bf16 buffers the pending backward saved come back, so backward gives the
        very gradients it gives without the window."""
        _, plain = reference_and_model(nn.Linear(8, 8))
        windowed = copy.deepcopy(plain)
        full_weight = plain.weight.detach().clone()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for model in (plain, windowed):
            fully_shard(model, mp_policy=policy, reshard_after_forward=False)
        inputs = make_inputs(0, self.rank)
        plain(inputs).sum().backward()
        loss = windowed(inputs).sum()
        group = windowed._get_fsdp_state().group
        self.assertTrue(group.is_unsharded)
        with group.unsharded_in_full_precision():
            self.assertEqual(windowed.weight.dtype, torch.float32)
            self.assertEqual(windowed.weight.shape, full_weight.shape)
            torch.testing.assert_close(windowed.weight.detach(), full_weight, rtol=0, atol=0)
        self.assertTrue(group.is_unsharded)
        self.assertEqual([m.param_dtype for m in group.members], [torch.bfloat16] * 2)
        loss.backward()
        for name, param in plain.named_parameters():
            other = windowed.get_parameter(name)
            torch.testing.assert_close(other.grad.to_local(), param.grad.to_local(), rtol=0, atol=0)
