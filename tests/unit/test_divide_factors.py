"""Which reduce ops and pre/post divide factors a reduction uses (SPEC §3.3)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from reffsdp.core.collectives import plan_reduction
from reffsdp.per_param.mesh import mesh_info_for
from reffsdp.testing.fake_pg import fake_process_group

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


@pytest.fixture
def mesh_info_8():
    with fake_process_group(8, 3):
        yield mesh_info_for(init_device_mesh("cpu", (8,)))


def _ops(plan):
    return plan.reduce_scatter_op, plan.all_reduce_op, plan.pre_factor, plan.post_factor


def test_fp32_and_bf16_average_inside_the_collective(mesh_info_8):
    for dtype in (torch.float32, torch.bfloat16):
        assert _ops(plan_reduction(mesh_info_8, dtype)) == (AVG, AVG, None, None)


def test_fp16_sums_with_pre_and_post_division(mesh_info_8):
    assert _ops(plan_reduction(mesh_info_8, torch.float16)) == (SUM, SUM, 4.0, 2.0)


def test_force_sum_divides_after_or_splits_for_fp16(mesh_info_8):
    plan = plan_reduction(mesh_info_8, torch.float32, force_sum=True)
    assert _ops(plan) == (SUM, SUM, None, 8.0)
    plan = plan_reduction(mesh_info_8, torch.float16, force_sum=True)
    assert _ops(plan) == (SUM, SUM, 4.0, 2.0)


def test_custom_factor(mesh_info_8):
    assert _ops(plan_reduction(mesh_info_8, torch.float32, divide_factor=8)) == (
        AVG,
        SUM,
        None,
        None,
    )
    plan = plan_reduction(mesh_info_8, torch.float32, divide_factor=3)
    assert plan.premul_factor == pytest.approx(1 / 3)
    assert (plan.pre_factor, plan.post_factor) == (None, None)
    plan = plan_reduction(mesh_info_8, torch.float16, divide_factor=16)
    assert _ops(plan) == (SUM, SUM, 4.0, 4.0)


def test_one_rank_sums():
    with fake_process_group(1, 0):
        info = mesh_info_for(init_device_mesh("cpu", (1,)))
        assert _ops(plan_reduction(info, torch.float32)) == (SUM, SUM, None, None)


def test_one_rank_divides_in_the_copy():
    with fake_process_group(1, 0):
        info = mesh_info_for(init_device_mesh("cpu", (1,)))
        plan = plan_reduction(info, torch.float32, divide_factor=2.0)
        assert _ops(plan) == (SUM, SUM, None, None)
        assert (plan.premul_factor, plan.copy_divisor) == (None, 2.0)
        assert plan_reduction(info, torch.float32, divide_factor=1.0).copy_divisor is None
