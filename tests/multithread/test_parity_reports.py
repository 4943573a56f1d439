"""What the parity suite's results say when a scenario fails, on threaded ranks: the failing
rank's own numbers when it is not rank 0, a crash's whole message and traceback, and the
tolerances as they were given."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from reffsdp.testing import parity
from reffsdp.testing.parity_suite import SuiteOptions, run_suite

pytestmark = pytest.mark.multithread

SCENARIO = ("fully_shard/1d/reshard/mlp",)


def test_a_mismatch_on_rank_2_alone_is_reported_with_rank_2s_numbers(monkeypatch):
    """Only rank 2's gradients are wrong: rank 0's own message would only say "rank 0
    matched" (and its differences are zero), so the result carries rank 2's."""
    real = parity._forward_backward

    def forward_backward(model, inputs, loss_fn, no_sync):
        losses = real(model, inputs, loss_fn, no_sync)
        if dist.get_rank() == 2 and not isinstance(model, DistributedDataParallel):
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(3.0)
        return losses

    monkeypatch.setattr(parity, "_forward_backward", forward_backward)
    (result,) = run_suite(SuiteOptions(only=SCENARIO, steps=1))
    assert result.status == "failed"
    first, *rest = result.message.splitlines()
    assert first.startswith("gradients: check_train_parity, step 0 after backward: grad of ")
    assert " on rank 2: max abs diff " in first, first
    assert rest[0] == "check_train_parity, step 0 after backward: parity check failed on rank 2:"
    problems = [line for line in rest[1:] if not line.startswith("  ... and ")]
    assert problems and all(" on rank 2: max abs diff " in line for line in problems), rest
    assert "matched" not in result.message
    assert result.max_grad_diff > 1e-3  # rank 2's, not rank 0's zero
    assert "AssertionError" in result.traceback and "check_train_parity" in result.traceback


def test_a_crash_keeps_its_whole_message_and_its_traceback(monkeypatch):
    from reffsdp.core.param_group import ParamGroup

    original = ParamGroup.post_backward
    message = (
        "Error(s) in loading state_dict for FullyShardedDataParallel:\n"
        '\tMissing key(s) in state_dict: "layers.0.weight".'
    )

    def post_backward(self):
        if dist.get_rank() == 1:
            raise RuntimeError(message)
        original(self)

    monkeypatch.setattr(ParamGroup, "post_backward", post_backward)
    (result,) = run_suite(SuiteOptions(only=SCENARIO, steps=1))
    assert result.status == "failed"
    assert result.message == f"error: RuntimeError: {message}"
    assert "rank 1 failed:" in result.traceback
    assert "in post_backward" in result.traceback and "test_parity_reports.py" in result.traceback
    assert json.loads(json.dumps(result.to_dict()))["traceback"] == result.traceback


def test_tolerances_are_reported_as_given():
    """A tolerance the scenario gives comes back as given (not float32-rounded); a derived
    one as the largest allowance a comparison used (see testing/tolerances.py)."""
    derived, given = run_suite(SuiteOptions(only=(*SCENARIO, "fully_shard/2d/fp32/mlp"), steps=1))
    for result in (derived, given):
        assert result.status == "passed", result.message
        assert result.traceback == ""
    assert (given.atol, given.rtol) == (1e-04, 1e-05)  # the tensor-parallel scenarios'
    assert derived.rtol == 0.0 and 0.0 < derived.atol < 1e-3
