"""Faults planted in the process group are caught under reffsdp's FSDP and torch's alike.

Each fault of :mod:`reffsdp.testing.planted_faults` sits below any FSDP implementation (see
[Note: where the faults sit] there), so one planted fault reaches reffsdp's ``fully_shard``
and wrapper and torch's ``fully_shard`` and ``FullyShardedDataParallel``. Every rank trains an
uneven MLP stack (15-row weights leave padding on two ranks) next to DDP: without a fault it
matches; under each fault the check fails. ``check_train_parity`` does the checking for
reffsdp (with the expected collective counts too) and for torch's ``fully_shard``; torch's
wrapper holds flat parameters that the checker does not unflatten, so its losses are compared
with DDP's at every step instead (a wrong gradient shows in the next step's loss).

A fault runs every collective as it was issued and changes only what the ranks receive, so
the collectives each rank issues (kinds, order and bytes) are the same with or without it:
what catches a fault is the numbers.

The same cases run over gloo processes in ``tests/multiprocess/test_planted_faults_gloo.py``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import reffsdp
from reffsdp.testing import planted_faults
from reffsdp.testing.build import wrap_blocks
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.expected_comms import expected_counts
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPBlocks, MLPStack, init_deterministic
from reffsdp.testing.multithread import RankFailure, run_threaded
from reffsdp.testing.parity import (
    check_train_parity,
    sgd_with_momentum,
    sum_loss,
    unflattened_params,
)

pytestmark = pytest.mark.multithread

WORLD_SIZE = 2
DIM = 5  # MLPStack(5): 15- and 20-row weights
STEPS = 3
make_inputs = random_inputs(3, DIM)

IMPLS = ("reffsdp", "torch")
APIS = ("fully_shard", "wrapper")
FAULTS: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "reduce-scatter scaled": planted_faults.reduce_scatter_scaled,
    "reduce-scatter drops a rank": planted_faults.reduce_scatter_drops_a_rank,
    "reduce-scatter skipped": planted_faults.reduce_scatter_skipped,
    "all-gather drops a rank": planted_faults.all_gather_drops_a_rank,
    "all-gather stale": planted_faults.all_gather_stale,
}
# Where each fault is first seen: a wrong reduction in the first gradients, a wrong gather
# in the first forward's loss. The stack's first and last blocks have one shape, so the
# stale gather hands the last block the first one's weights from the start (with blocks of
# distinct sizes it shows a step later: test_a_stale_gather_shows_in_the_next_step).
FIRST_SEEN = {
    "reduce-scatter scaled": "step 0 after backward",
    "reduce-scatter drops a rank": "step 0 after backward",
    "reduce-scatter skipped": "step 0 after backward",
    "all-gather drops a rank": "step 0 losses",
    "all-gather stale": "step 0 losses",
}
PARITY_FAILED = "parity check failed on rank"


def stack() -> nn.Module:
    """Three MLP blocks, the first and last of one shape; the root holds no parameter."""
    return init_deterministic(MLPStack(DIM))


def blocks_of_distinct_sizes() -> nn.Module:
    """A root ``proj`` and two MLP blocks, every group of its own size."""
    return init_deterministic(MLPBlocks(DIM))


def shard(impl: str, api: str, model: nn.Module) -> nn.Module:
    """``model`` sharded block by block (its :class:`MLP` modules), then the root, by
    ``impl``'s ``api``."""
    if api == "wrapper":
        if impl == "reffsdp":
            return wrap_blocks(model, {MLP})
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({MLP})
        return FullyShardedDataParallel(
            model, auto_wrap_policy=policy, device_id=torch.device("cpu")
        )
    if impl == "reffsdp":
        fully_shard = reffsdp.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in [m for m in model.modules() if isinstance(m, MLP)]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_next_to_ddp(impl: str, api: str, build: Callable[[], nn.Module] = stack) -> None:
    """On every rank: train the sharded model next to DDP for ``STEPS`` steps; raises
    ``AssertionError`` on every rank when they disagree."""
    model = build()
    ref_model = copy.deepcopy(model)
    counts = expected_counts(model, [MLP], api=api)
    sharded = shard(impl, api, model)
    if impl == "reffsdp":
        check_train_parity(
            None, ref_model, sharded, make_inputs, num_steps=STEPS, expected_counts=counts
        )
    elif api == "fully_shard":  # the checker counts reffsdp's collectives only
        check_train_parity(None, ref_model, sharded, make_inputs, num_steps=STEPS)
    else:
        losses_match_ddp(ref_model, sharded)


def losses_match_ddp(ref_model: nn.Module, model: nn.Module) -> None:
    """Train ``model`` and a DDP copy of ``ref_model`` side by side; every step's loss must
    match on every rank (the ranks agree on the verdict with one all-reduce at the end)."""
    ddp = DistributedDataParallel(ref_model)
    models = (ddp, model)
    optimizers = [sgd_with_momentum(m.parameters()) for m in models]
    problems = []
    for step in range(STEPS):
        inputs = make_inputs(step, dist.get_rank())
        ref_loss, loss = (_train_step(m, o, inputs) for m, o in zip(models, optimizers))
        if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5):
            problems.append(f"step {step} loss {loss.item():.6g} vs DDP's {ref_loss.item():.6g}")
    failed = torch.tensor([float(bool(problems))])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise AssertionError(f"losses differ from DDP's on rank {dist.get_rank()}: {problems}")


def _train_step(model: nn.Module, optimizer: Any, inputs: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = sum_loss(model(inputs))
    loss.backward()
    optimizer.step()
    return loss.detach()


def collectives_of_training(impl: str, api: str) -> list[tuple[Any, int]]:
    """``(kind, bytes)`` of every collective this rank issues in two training steps of the
    sharded stack alone (no reference, no checks)."""
    model = shard(impl, api, stack())
    optimizer = sgd_with_momentum(model.parameters())
    with CommCounter() as counter:
        for step in range(2):
            _train_step(model, optimizer, make_inputs(step, dist.get_rank()))
    return counter.get_comm_sequence()


def failure_under(fault: str | None, fn: Callable[[int], None]) -> str:
    """Run ``fn(rank)`` on threaded ranks under ``fault`` (none when ``None``); the
    failure's text, ``""`` when every rank passed."""
    plant = FAULTS[fault] if fault is not None else contextlib.nullcontext
    try:
        with plant():
            run_threaded(fn, WORLD_SIZE)
    except RankFailure as failure:
        return str(failure)
    return ""


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("impl", IMPLS)
def test_training_matches_ddp_without_a_fault(impl, api):
    assert failure_under(None, lambda rank: train_next_to_ddp(impl, api)) == ""


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("impl", IMPLS)
def test_each_fault_fails_the_check(impl, api, fault):
    failure = failure_under(fault, lambda rank: train_next_to_ddp(impl, api))
    if impl == "torch" and api == "wrapper":
        assert "losses differ from DDP's" in failure, failure
    else:
        assert f"check_train_parity, {FIRST_SEEN[fault]}: {PARITY_FAILED}" in failure, failure


@pytest.mark.parametrize("impl", IMPLS)
def test_a_stale_gather_shows_in_the_next_step(impl):
    """Every group of its own size: only the next step's forward meets weights from before
    the optimizer step (the backward's gather returns the forward's, which are current)."""
    failure = failure_under(
        "all-gather stale",
        lambda rank: train_next_to_ddp(impl, "fully_shard", blocks_of_distinct_sizes),
    )
    assert f"check_train_parity, step 1 losses: {PARITY_FAILED}" in failure, failure


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("impl", IMPLS)
def test_a_fault_changes_no_collective_only_what_it_delivers(impl, api):
    issued: dict[str | None, list] = {}

    def record(fault: str | None) -> Callable[[int], None]:
        def on_rank(rank: int) -> None:
            sequence = collectives_of_training(impl, api)
            if rank == 0:
                issued[fault] = sequence

        return on_rank

    for fault in (None, *FAULTS):
        assert failure_under(fault, record(fault)) == ""
    assert issued[None], "no collective seen"
    for fault in FAULTS:
        assert issued[fault] == issued[None], fault


def test_the_checkers_gathers_are_left_alone():
    """The checker gathers into tensors of their own and ``all_gather_object`` into a byte
    buffer: an all-gather fault reaches neither (see [Note: where the faults sit])."""
    seen: dict[str | None, tuple] = {}

    def record(fault: str | None) -> Callable[[int], None]:
        def on_rank(rank: int) -> None:
            model = wrap_blocks(stack(), {MLP})
            params = {name: param.clone() for name, (param, _) in unflattened_params(model).items()}
            objects: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(objects, {"rank": rank})
            if rank == 0:
                seen[fault] = (params, objects)

        return on_rank

    for fault in (None, "all-gather drops a rank"):
        assert failure_under(fault, record(fault)) == ""
    (clean_params, clean_objects), (params, objects) = seen[None], seen["all-gather drops a rank"]
    assert objects == clean_objects == [{"rank": 0}, {"rank": 1}]
    assert params.keys() == clean_params.keys()
    for name, param in params.items():
        assert torch.equal(param, clean_params[name]), name
