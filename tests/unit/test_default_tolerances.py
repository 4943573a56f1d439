"""The default tolerance widened to the sharded model's reduce dtype (point 6 of [Note: default
tolerances] in ``testing/tolerances.py``), and left as it was for fp32."""

from __future__ import annotations

import pytest
import torch

from reffsdp.testing.tolerances import (
    MAX_DOUBLINGS,
    Tolerances,
    default_tolerance,
    reduction_roundings,
    subnormal_floor,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_WHOLE = torch.tensor([0.5, -0.25, 20.0])


@pytest.mark.parametrize("reduce_dtype", [None, FP32, torch.float64])
@pytest.mark.parametrize("reductions", [1, 3, 50])
def test_the_fp32_default_is_unchanged_unless_the_reduction_is_narrower(reduce_dtype, reductions):
    """The formula as it was before the reduce dtype was read, bit for bit."""
    growth = 2 ** min(reductions, MAX_DOUBLINGS)
    before = growth * reduction_roundings(4, 2) * torch.finfo(FP32).eps
    tolerances = Tolerances(world_size=4, num_microbatches=2, reduce_dtype=reduce_dtype)
    assert default_tolerance(FP32, 4, 2, reductions, reduce_dtype) == before
    assert tolerances.for_comparison(_WHOLE, None, reductions) == (0.0, before * 20.0)


def test_a_narrower_reduction_sets_eps_and_fp16_adds_its_subnormals():
    n = reduction_roundings(2)
    bf16 = Tolerances(world_size=2, reduce_dtype=BF16).for_comparison(_WHOLE, None, 1)
    assert bf16 == (0.0, pytest.approx(2 * n * 2**-7 * 20.0))
    fp16 = Tolerances(world_size=2, reduce_dtype=FP16).for_comparison(_WHOLE, None, 1)
    assert fp16 == (0.0, pytest.approx(2 * n * (2**-10 * 20.0 + 2**-24)))
    assert subnormal_floor(FP32, 2, reduce_dtype=FP16) == pytest.approx(2 * n * 2**-24)


def test_a_tensor_narrower_than_the_reduction_keeps_its_own_eps():
    assert default_tolerance(BF16, 4, reduce_dtype=FP32) == default_tolerance(BF16, 4)
    assert default_tolerance(BF16, 4, reduce_dtype=FP16) == default_tolerance(BF16, 4)
    assert subnormal_floor(BF16, 4, reduce_dtype=FP32) == 0.0
    assert default_tolerance(torch.int64, 4, reduce_dtype=BF16) == 0.0


def test_the_callers_tolerance_replaces_the_widened_default():
    tolerances = Tolerances(rtol=1e-5, atol=1e-6, world_size=2, reduce_dtype=BF16)
    assert tolerances.for_comparison(_WHOLE, None, 1) == (1e-5, 1e-6)
