"""The parity API's options for a user's own model, checked without ranks: losses of output
objects, tolerances per dtype, integer inputs under the bf16 reference, and every option of
``parity_scenarios`` that must refuse rather than pass silently."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from reffsdp.testing import expected_counts, parity_scenarios
from reffsdp.testing.expected_comms import StepShape, expected_per_step, fully_shard_units
from reffsdp.testing.models import MLP, MLPStack
from reffsdp.testing.parity import LowPrecisionCompute, sum_loss
from reffsdp.testing.preflight import blocks_of, unsharded_blocks
from reffsdp.testing.tolerances import Tolerances, default_tolerance, reduction_roundings

BF16 = torch.bfloat16


class OutputObject:
    """A model output that is neither a tensor nor a container of them."""


class Cache:
    pass


def _inputs(iteration, rank):
    return torch.zeros(2, 4)


# -- item 3: a loss for any output, tolerances per dtype ------------------------------------


def test_sum_loss_adds_every_tensor_of_nested_outputs():
    output = {"logits": torch.ones(2, 3), "extra": [torch.full((2,), 2.0), None]}
    assert sum_loss(output).item() == 10.0
    assert sum_loss((torch.ones(2), torch.ones(3, dtype=BF16))).dtype == torch.float32


def test_sum_loss_asks_for_a_loss_fn_when_the_output_holds_other_objects():
    output = {"loss": torch.tensor(1.0), "cache": Cache()}
    with pytest.raises(TypeError, match=r"its dict holds Cache; pass loss_fn=.*out\.loss"):
        sum_loss(output)
    with pytest.raises(TypeError, match=r"it returned a OutputObject; pass loss_fn="):
        sum_loss(OutputObject())


def test_the_default_tolerance_grows_with_ranks_microbatches_and_steps():
    eps = torch.finfo(torch.float32).eps
    assert reduction_roundings(1) == 4  # the scalings alone
    assert reduction_roundings(4) == 2 * 3 + 4
    assert reduction_roundings(8, num_microbatches=3) == 2 * 7 + 2 * 2 + 4
    assert default_tolerance(torch.float32, 4) == pytest.approx(2 * 10 * eps)
    assert default_tolerance(torch.float32, 4, reductions=3) == pytest.approx(8 * 10 * eps)
    assert default_tolerance(BF16, 4) == pytest.approx(2 * 10 * torch.finfo(BF16).eps)
    assert default_tolerance(torch.int64, 4) == 0.0


def test_the_default_is_normwise_over_the_whole_reference():
    tolerances = Tolerances(world_size=4)
    piece = torch.tensor([0.5, -0.25])
    whole = torch.tensor([0.5, -0.25, 20.0, float("nan")])
    rtol, atol = tolerances.for_comparison(piece, whole, reductions=2)
    assert rtol == 0.0
    assert atol == pytest.approx(4 * 10 * torch.finfo(torch.float32).eps * 20.0)
    assert tolerances.for_comparison(torch.arange(3), None, 1) == (0.0, 0.0)


def test_given_tolerances_apply_per_dtype_and_need_both():
    tolerances = Tolerances(rtol={BF16: 1e-2}, atol={BF16: 1e-3}, world_size=4)
    assert tolerances.given(BF16) == (1e-2, 1e-3)
    assert tolerances.given(torch.float32) is None  # the derived default
    assert Tolerances(rtol=0.0, atol=1e-4).given(torch.float64) == (0.0, 1e-4)
    with pytest.raises(ValueError, match="needs both rtol and atol, got no rtol"):
        Tolerances(atol=1e-4).given(torch.float32)
    with pytest.raises(ValueError, match="must not be negative"):
        Tolerances(rtol=-1.0, atol=0.0)


def test_parity_scenarios_pass_loss_optimizer_and_tolerances_to_the_check():
    def loss_fn(out):
        return out["loss"]

    def adam(params):
        return torch.optim.Adam(params, lr=1e-4)

    scenarios = parity_scenarios(
        lambda: nn.Linear(4, 4),
        _inputs,
        loss_fn=loss_fn,
        optimizer_factory=adam,
        rtol={BF16: 1e-2},
        atol={BF16: 1e-2},
    )
    kwargs = scenarios[0].spec.custom.check_kwargs()
    assert kwargs["loss_fn"] is loss_fn and kwargs["optimizer_factory"] is adam
    assert kwargs["rtol"] == {BF16: 1e-2} and kwargs["atol"] == {BF16: 1e-2}
    plain = parity_scenarios(lambda: nn.Linear(4, 4), _inputs)[0].spec.custom.check_kwargs()
    assert plain == {"rtol": None, "atol": None}  # the suite's optimizer and sum_loss


# -- item 4: the bf16 reference casts floating-point inputs only ----------------------------


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, input_ids, mask=None, extra=()):
        hidden = self.proj(self.embed(input_ids))
        if mask is not None:
            hidden = hidden * mask[..., None]
        return {"hidden": hidden, "ids": input_ids, "extra": list(extra)}


def test_the_bf16_reference_casts_only_floating_inputs_through_any_nesting():
    ref = LowPrecisionCompute(TokenModel(), BF16, output_dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    out = ref(ids, mask=torch.ones(1, 3), extra=[torch.ones(2, dtype=torch.float64)])
    assert out["ids"].dtype == torch.int64 and torch.equal(out["ids"], ids)
    assert out["hidden"].dtype == torch.float32  # computed in bf16, cast on the way out
    assert out["extra"][0].dtype == torch.float32
    computed = TokenModel().to(BF16)
    computed.load_state_dict(ref.module.state_dict())
    expected = computed(ids, mask=torch.ones(1, 3, dtype=BF16))["hidden"].float()
    torch.testing.assert_close(out["hidden"], expected, rtol=0, atol=0)


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    mask: torch.Tensor


class BatchModel(TokenModel):
    def forward(self, batch: Batch):  # type: ignore[override]
        assert batch.mask.dtype == BF16 and batch.input_ids.dtype == torch.int64
        return super().forward(batch.input_ids, batch.mask)


def test_the_bf16_reference_enters_dataclass_inputs_as_fsdp_does():
    ref = LowPrecisionCompute(BatchModel(), BF16)
    out = ref(Batch(torch.tensor([[1, 2]]), torch.ones(1, 2)))
    assert out["hidden"].dtype == BF16


# -- item 5: no silent pass -----------------------------------------------------------------


def test_unknown_features_are_refused():
    with pytest.raises(ValueError, match=r"unknown feature\(s\) \['fp23'\]; pick from"):
        parity_scenarios(lambda: nn.Linear(4, 4), _inputs, features=["fp32", "fp23"])
    with pytest.raises(ValueError, match=r"unknown feature\(s\) \['tied'\]"):
        parity_scenarios(lambda: nn.Linear(4, 4), _inputs, features=["tied"])  # built-in only
    with pytest.raises(ValueError, match="unknown feature"):
        parity_scenarios(features=["bf-16"])
    with pytest.raises(TypeError, match="not a string"):
        parity_scenarios(lambda: nn.Linear(4, 4), _inputs, features="bf16")


def test_a_selection_without_scenarios_is_refused():
    with pytest.raises(ValueError, match="no scenario runs"):
        parity_scenarios(
            lambda: nn.Linear(4, 4), _inputs, apis=["fully_shard"], features=["orig-params"]
        )


def test_block_types_must_be_module_classes():
    with pytest.raises(TypeError, match="block_types must be nn.Module subclasses"):
        parity_scenarios(lambda: nn.Linear(4, 4), _inputs, block_types=[nn.Linear(2, 2)])


def test_options_for_a_users_model_need_the_model():
    with pytest.raises(ValueError, match="loss_fn apply to your own model"):
        parity_scenarios(loss_fn=lambda out: out)


def test_block_types_that_match_nothing_are_an_error():
    with pytest.raises(ValueError, match=r"block_types \(Conv2d\) match no module of MLPStack"):
        blocks_of(MLPStack(4), [nn.Conv2d])
    assert len(blocks_of(MLPStack(4), [MLP])) == 3


def test_blocks_of_an_unsharded_model_are_reported_unsharded():
    assert unsharded_blocks(MLPStack(4), [MLP]) == ["0 (MLP)", "1 (MLP)", "2 (MLP)"]


def test_expected_counts_for_a_users_model():
    model = MLPStack(5)
    counts = expected_counts(model, [MLP], shard_size=2)
    # Three blocks gathered in forward and again in backward, the root's group (no
    # parameters of its own) none; one reduce-scatter per block.
    assert counts == {"all_gather": 6.0, "reduce_scatter": 3.0, "all_reduce": 0.0}
    units = fully_shard_units([*model, model], 2)
    assert counts == expected_per_step(units, StepShape(2))[0]
    hsdp = expected_counts(model, [MLP], shard_size=2, replicate_size=2)
    assert hsdp["all_reduce"] == 3.0
    kept = expected_counts(model, [MLP], shard_size=2, reshard_after_forward=False)
    assert kept["all_gather"] == 3.0
    wrapper = expected_counts(model, [MLP], shard_size=2, api="wrapper")
    assert wrapper == counts
    accum = expected_counts(
        model, [MLP], shard_size=2, num_microbatches=2, sync_every_microbatch=False
    )
    assert accum == {"all_gather": 12.0, "reduce_scatter": 3.0, "all_reduce": 0.0}
    with pytest.raises(ValueError, match="api must be"):
        expected_counts(model, [MLP], shard_size=2, api="fsdp2")
