"""Training with fp8 all-gather weights (``reffsdp.testing.low_precision``) next to DDP, on
threaded ranks, under torch's ``fully_shard`` and under reffsdp's.

The runs under torch's ``fully_shard`` check the subclass and its reference on their own:
both hook forms, 2 and 4 ranks, 1-D and HSDP meshes; a reference without quantization
fails (so a gather that skipped the hooks would be seen), and so does a post-all-gather
hook that ignores ``out=``. The same runs under reffsdp's ``fully_shard`` (ids ending in
``reffsdp``) hold it to the all-gather extension contract (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import reffsdp
from reffsdp.core.comms import Collective
from reffsdp.testing.build import build_seeded
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.expected_comms import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    StepShape,
    expected_per_step,
    ring_bytes,
)
from reffsdp.testing.impls import load_implementation
from reffsdp.testing.inputs import random_inputs, random_tokens
from reffsdp.testing.low_precision import (
    Float8GatherReference,
    Float8GatherWeight,
    float8_weight_names,
    to_float8_gather,
)
from reffsdp.testing.models import MLPStack, ModelArgs, Transformer, init_deterministic
from reffsdp.testing.multithread import run_threaded
from reffsdp.testing.parity import (
    Passthrough,
    broadcast_params_from_rank0,
    check_train_parity,
    sum_loss,
)
from reffsdp.testing.self_test import bug_context
from reffsdp.testing.suite_scenarios import LocalSGD, all_specs, build_scenario

pytestmark = pytest.mark.multithread

SHARDERS: dict[str, Callable[..., Any]] = {
    "torch": torch_fully_shard,
    "reffsdp": reffsdp.fully_shard,
}
OUT_IGNORED = "post-all-gather hook ignores out="
PARITY_FAILED = "parity check failed on rank"  # check_train_parity's verdict, not a crash


def _mlp_case() -> tuple[Any, list, Callable, Callable | None]:
    """An uneven MLP stack (15- and 5-row weights), the plain SGD of the suite."""
    model = init_deterministic(MLPStack(5))
    return model, list(model), random_inputs(3, 5), LocalSGD


def _transformer_case() -> tuple[Any, list, Callable, Callable | None]:
    """A transformer whose linear rows divide evenly, SGD with momentum."""
    model = build_seeded(lambda: Transformer(ModelArgs()), 0)
    broadcast_params_from_rank0(model)
    return model, list(model.layers), random_tokens(ModelArgs().vocab_size, 2, 8), None


CASES = {"mlp": _mlp_case, "transformer": _transformer_case}


def _train(
    sharder: str,
    world_size: int,
    model_kind: str,
    hook_arguments: int,
    *,
    hsdp: bool = False,
    quantized_reference: bool = True,
    steps: int = 3,
) -> None:
    """On every rank: shard the case's model with fp8 all-gather weights and train it next to
    its DDP reference with ``check_train_parity`` (which raises on a mismatch)."""
    fully_shard = SHARDERS[sharder]

    def on_rank(rank: int) -> None:
        model, blocks, make_inputs, optimizer = CASES[model_kind]()
        names = float8_weight_names(model) if quantized_reference else []
        ref_model = Float8GatherReference(copy.deepcopy(model), names)
        to_float8_gather(model, hook_arguments)
        if hsdp:
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("r", "s"))
        else:
            mesh = init_device_mesh("cpu", (world_size,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        losses = check_train_parity(
            None,
            ref_model,
            Passthrough(model),
            make_inputs,
            num_steps=steps,
            optimizer_factory=optimizer,
        )
        assert all(loss != 0.0 for loss in losses), losses  # nothing died
        for name in names:
            assert isinstance(model.get_parameter(name).to_local(), Float8GatherWeight), name

    run_threaded(on_rank, world_size, timeout_s=180)


@pytest.mark.parametrize("sharder", ["torch", "reffsdp"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "model_kind, hook_arguments", [("mlp", 1), ("transformer", 1), ("transformer", 5)]
)
def test_training_with_fp8_all_gathers_matches_the_quantized_ddp_reference(
    sharder, world_size, model_kind, hook_arguments
):
    _train(sharder, world_size, model_kind, hook_arguments)


@pytest.mark.parametrize("sharder", ["torch", "reffsdp"])
@pytest.mark.parametrize("hook_arguments", [1, 5])
def test_hsdp_training_with_fp8_all_gathers_matches_the_quantized_ddp_reference(
    sharder, hook_arguments
):
    _train(sharder, 4, "transformer", hook_arguments, hsdp=True)


def test_a_reference_without_quantization_fails_at_the_first_loss():
    """The quantization shows in the numbers: had a gather skipped the hooks (sent the fp32
    shard), the quantized reference would fail the same way."""
    with pytest.raises(Exception, match="step 0 losses: " + PARITY_FAILED):
        _train("torch", 2, "mlp", 1, quantized_reference=False, steps=1)


@pytest.mark.parametrize("sharder", ["torch", "reffsdp"])
def test_a_post_all_gather_hook_that_ignores_out_is_caught(sharder):
    """The refill of the self-test's planted bug: the unsharded weight keeps whatever its
    storage held (torch frees it on reshard, so it is garbage there; stale values where
    the storage is kept)."""
    _train(sharder, 2, "mlp", 1, steps=2)  # passes without the bug
    with bug_context(OUT_IGNORED)(), pytest.raises(Exception, match=PARITY_FAILED):
        _train(sharder, 2, "mlp", 1, steps=2)


# -- the suite's fp8-gather scenarios, sharded by torch ----------------------------------------


def _sent_per_rank(counter: CommCounter, shape: StepShape) -> tuple[dict[str, float], Fraction]:
    """Counts and ring bytes sent per rank (see [Note: bytes sent per rank] in
    reffsdp.testing.expected_comms): gathers and reduce-scatters over the shard group,
    all-reduces over the replicas."""
    counts, nbytes = counter.get_comm_counts(), counter.get_comm_bytes()
    s, r = shape.shard_size, shape.replicate_size
    sent = ring_bytes(nbytes[Collective.ALL_GATHER] + nbytes[Collective.REDUCE_SCATTER], s)
    sent += 2 * ring_bytes(nbytes[Collective.ALL_REDUCE], r)
    kinds = {ALL_GATHER: Collective.ALL_GATHER, REDUCE_SCATTER: Collective.REDUCE_SCATTER}
    kinds[ALL_REDUCE] = Collective.ALL_REDUCE
    return {key: float(counts[kind]) for key, kind in kinds.items()}, sent


@pytest.mark.parametrize(
    "name", ["fully_shard/1d/fp8-gather/mlp", "fully_shard/hsdp/fp8-gather/transformer"]
)
def test_the_fp8_gather_scenarios_pass_under_torchs_fully_shard_which_sends_the_bytes_expected(
    name,
):
    """The scenario as the suite builds it, with torch's ``fully_shard`` in reffsdp's place:
    its numbers agree with the reference within the default tolerances, and one more step
    issues the collectives, and sends the bytes, that ``expected_per_step`` computes from
    the hooks' inputs."""
    (spec,) = [s for s in all_specs() if s.name == name]
    torch_impl = load_implementation("torch")

    def on_rank(rank: int) -> None:
        built = build_scenario(spec, torch.device("cpu"), torch_impl)
        kwargs = built.check_kwargs
        losses = check_train_parity(
            None, built.ref_model, built.model, built.make_inputs, num_steps=3, **kwargs
        )
        assert losses.max_grad_diff is not None
        with CommCounter() as counter:
            sum_loss(built.model(built.make_inputs(3, rank))).backward()
        counts, sent = _sent_per_rank(counter, built.shape)
        expected_counts, minimum = expected_per_step(built.units, built.shape)
        assert counts == expected_counts, (counts, expected_counts)
        assert sent == minimum, (float(sent), float(minimum))
        fp32 = dataclasses.replace(built.units[0], gather_nbytes=None).gathered_bytes
        assert built.units[0].gathered_bytes < 0.5 * fp32  # fp8, plus a scale per row

    run_threaded(on_rank, 4, timeout_s=180)
