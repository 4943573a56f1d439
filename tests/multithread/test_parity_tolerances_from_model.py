"""Default tolerances from the sharded model's declared mixed precision, whoever sharded it.

The reduce dtype is read from torch's and reffsdp's modules under both APIs (point 6 of
[Note: default tolerances] in ``testing/tolerances.py``): a reduction in bf16 or fp16 that
was asked for passes with the defaults, one in bf16 where fp32 was asked for fails.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

import reffsdp
from reffsdp.core import compat
from reffsdp.testing import build_seeded
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread, run_threaded
from reffsdp.testing.parity import LowPrecisionCompute, Passthrough, check_train_parity
from reffsdp.testing.self_test import bug_context
from reffsdp.testing.tolerances import model_reduce_dtype
from reffsdp.wrap import ModuleWrapPolicy

pytestmark = pytest.mark.multithread

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CPU = torch.device("cpu")
DIM = 16
_IMPLS = {"reffsdp": reffsdp, "torch": torch_fsdp}


def _models() -> tuple[nn.Module, nn.Module]:
    """``(reference, model to shard)``: the same weights on every rank."""
    model = build_seeded(lambda: MLPStack(DIM), seed=0)
    return copy.deepcopy(model), model


def _shard(
    model: nn.Module,
    impl: str,
    api: str,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    **wrapper_kwargs,
) -> nn.Module:
    """``model`` sharded by ``impl`` ("reffsdp" or "torch") through ``api`` ("fully_shard":
    each MLP, then the root; "wrapper": an instance per MLP and one at the root)."""
    lib = _IMPLS[impl]
    if api == "fully_shard":
        policy = lib.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in model:
            lib.fully_shard(block, mp_policy=policy)
        return lib.fully_shard(model, mp_policy=policy)
    if impl == "torch":
        wrapper_kwargs.update(
            auto_wrap_policy=torch_fsdp.wrap.ModuleWrapPolicy({MLP}), device_id=CPU
        )
    else:
        wrapper_kwargs.update(auto_wrap_policy=ModuleWrapPolicy({MLP}))
    mixed_precision = lib.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return lib.FullyShardedDataParallel(model, mixed_precision=mixed_precision, **wrapper_kwargs)


class TestParityOnAnyImplementation(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_a_reduction_in_low_precision_passes_with_the_defaults(self):
        """Reduce-only bf16 or fp16 (fp32 parameters): before the reduce dtype was read,
        step 0 failed on the gradients with fp32's tolerance (``max abs diff 0.000142``
        against ``atol=5.49e-08`` for bf16 on this model)."""
        self.run_subtests(
            {
                "impl": ["reffsdp", "torch"],
                "api": ["fully_shard", "wrapper"],
                "dtype": [BF16, FP16],
            },
            self._check_low_precision_reduction,
        )

    def _check_low_precision_reduction(self, impl: str, api: str, dtype: torch.dtype) -> None:
        ref_model, model = _models()
        model = _shard(model, impl, api, reduce_dtype=dtype)
        self.assertEqual(model_reduce_dtype(model), dtype)
        result = check_train_parity(self, ref_model, model, random_inputs(4, DIM))
        # The reduction did round, far beyond fp32's roundings of these gradients (< 1e-7).
        self.assertGreater(result.max_grad_diff, 1e-5)

    def test_the_declared_reduce_dtype_is_read_from_every_implementation(self):
        """``model_reduce_dtype``: the declared ``reduce_dtype``, else the API's fallback
        (the wrapper's ``param_dtype``; ``fully_shard``'s compute dtype up to torch 2.14,
        the parameter's own from 2.15); ``None`` when no gradient is reduced narrower than
        its own dtype, which leaves fp32's default unchanged."""
        fully_shard_fallback = BF16 if compat.TORCH_VERSION < (2, 15) else None
        cases = [
            ("fully_shard", None, None, None),
            ("fully_shard", None, FP32, None),
            ("fully_shard", BF16, FP32, None),
            ("fully_shard", None, BF16, BF16),
            ("fully_shard", BF16, None, fully_shard_fallback),
            ("wrapper", None, None, None),
            ("wrapper", BF16, FP32, None),
            ("wrapper", None, FP16, FP16),
            ("wrapper", BF16, None, BF16),
        ]
        for impl in _IMPLS:
            for api, param_dtype, reduce_dtype, expected in cases:
                with self.subTest(impl=impl, api=api, param=param_dtype, reduce=reduce_dtype):
                    _, model = _models()
                    model = _shard(
                        model, impl, api, param_dtype=param_dtype, reduce_dtype=reduce_dtype
                    )
                    self.assertEqual(model_reduce_dtype(Passthrough(model)), expected)
        self.assertIsNone(model_reduce_dtype(MLPStack(DIM)))


# -- a reduction done in bf16 where fp32 was asked for ---------------------------------------


@pytest.mark.parametrize("api", ["fully_shard", "wrapper"])
def test_an_fp32_asked_reduction_done_in_bf16_fails(api):
    """bf16 compute with an fp32 reduction (the suite's ``bf16`` feature) passes with the
    defaults; with the self-test's bug planted, reffsdp reducing in the compute dtype, the
    check holds the model to the fp32 tolerance it asked for and fails at step 0. The plant
    is process-wide, so it is entered here, outside the rank threads."""
    outcome = {}

    def on_rank(rank: int) -> None:
        ref_model, model = _models()
        model = _shard(model, "reffsdp", api, param_dtype=BF16, reduce_dtype=FP32)
        ref_model, model = LowPrecisionCompute(ref_model, BF16), Passthrough(model)
        try:
            result = check_train_parity(None, ref_model, model, random_inputs(4, DIM))
        except AssertionError as error:
            outcome[rank] = str(error)
        else:
            outcome[rank] = result.diffs

    run_threaded(on_rank, 2)
    for diffs in outcome.values():
        assert not isinstance(diffs, str), diffs
    with bug_context("mixed-precision reduce in the wrong dtype")():
        run_threaded(on_rank, 2)
    for message in outcome.values():
        assert isinstance(message, str), message
        assert "step 0 after backward" in message and "grad of" in message, message
        # held to fp32's tolerance, which bf16's rounding exceeds hundreds of times
        found = re.findall(r"max abs diff ([0-9.e+-]+) \(rtol=0, atol=([0-9.e+-]+)\)", message)
        assert found and all(float(diff) > 100 * float(atol) for diff, atol in found), message
