"""The parity checks catch planted bugs in ``fully_shard``'s collectives.

Each test plants one bug through the comms seam (no module is monkeypatched) and trains a
sharded ``MLPStack`` next to DDP with ``check_train_parity``, which must then fail on every
rank. The same run without the bug, or with an interceptor that only passes collectives
through, must pass: together that is the proof that a passing parity test means something.

Ranks see different inputs, so averaging over ranks matters, and the stack's 15-row layers
do not divide by the world size, so padding is exercised too.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from reffsdp.core import compat
from reffsdp.testing.build import shard_bottom_up
from reffsdp.testing.models import MLPStack, init_deterministic
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity
from reffsdp.testing.patching import patch_all_gather, patch_all_reduce, patch_reduce_scatter

pytestmark = pytest.mark.multithread

DIM = 5
# Where check_train_parity first fails: a gradient bug shows after the first backward, an
# unsharded parameter bug already in the first forward's loss.
GRADS = "step 0 after backward"
LOSSES = "step 0 losses"


def _inputs(iteration: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * iteration + rank)
    return torch.randn(4, DIM, generator=generator)


def _finished(work: dist.Work | None) -> None:
    """Wait for a collective so its output can be tampered with afterwards."""
    if work is not None:
        work.wait()


# -- planted bugs: each is a stand-in for a torch collective (see testing/patching.py) -----


def reduce_scatter_sum_not_avg(output, input, op=None, group=None, async_op=False):
    """Wrong divide factor: sum the gradients where the plan averages them."""
    assert op == dist.ReduceOp.AVG, f"this bug needs an AVG reduce-scatter, got {op}"
    return compat.reduce_scatter_single()(
        output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )


def reduce_scatter_scaled(output, input, op=None, group=None, async_op=False):
    """Wrong divide factor whatever the plan: the reduced shard comes back doubled."""
    work = compat.reduce_scatter_single()(output, input, op=op, group=group, async_op=async_op)
    _finished(work)
    output.mul_(2)
    return work


def reduce_scatter_skipped_zeros(output, input, op=None, group=None, async_op=False):
    """No reduce-scatter at all: the output buffer is left as zeros."""
    output.zero_()


def reduce_scatter_skipped_local(output, input, op=None, group=None, async_op=False):
    """No reduce-scatter at all: each rank keeps its own unreduced chunk."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    output.copy_(input.view(world_size, -1)[rank])


def all_gather_missing_peer_copy(output, input, group=None, async_op=False):
    """The gathered buffer misses the last rank's copy: its rows hold garbage."""
    work = compat.all_gather_single()(output, input, group=group, async_op=async_op)
    _finished(work)
    rows = output.view(dist.get_world_size(group), -1)
    rows[-1].fill_(0.5)
    return work


def passthrough_all_gather(output, input, group=None, async_op=False):
    return compat.all_gather_single()(output, input, group=group, async_op=async_op)


def passthrough_reduce_scatter(output, input, op=None, group=None, async_op=False):
    return compat.reduce_scatter_single()(output, input, op=op, group=group, async_op=async_op)


@contextlib.contextmanager
def passthrough_both() -> Iterator[None]:
    with patch_all_gather(passthrough_all_gather), patch_reduce_scatter(passthrough_reduce_scatter):
        yield


class TestPlantedBugs(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _train(self, patch: Callable[[], object] | None) -> None:
        """``check_train_parity`` of a sharded MLPStack vs DDP, under ``patch()`` if given."""
        model = MLPStack(DIM)
        init_deterministic(model)
        ref_model = copy.deepcopy(model)
        shard_bottom_up(model, model, mesh=init_device_mesh("cpu", (self.world_size,)))
        if patch is None:
            check_train_parity(self, ref_model, model, _inputs, num_steps=2)
            return
        with patch():
            check_train_parity(self, ref_model, model, _inputs, num_steps=2)

    def _assert_caught(self, patch: Callable[[], object], stage: str) -> None:
        """Training under ``patch`` fails on this rank, first at the check named ``stage``."""
        with self.assertRaises(AssertionError) as caught:
            self._train(patch)
        self.assertIn(f"check_train_parity, {stage}", str(caught.exception))

    def test_unpatched_and_passthrough_runs_pass(self):
        self._train(None)
        self._train(passthrough_both)

    def test_wrong_divide_factor_is_caught(self):
        self._assert_caught(lambda: patch_reduce_scatter(reduce_scatter_sum_not_avg), GRADS)
        self._assert_caught(lambda: patch_reduce_scatter(reduce_scatter_scaled), GRADS)

    def test_skipped_reduce_scatter_is_caught(self):
        self._assert_caught(lambda: patch_reduce_scatter(reduce_scatter_skipped_zeros), GRADS)
        self._assert_caught(lambda: patch_reduce_scatter(reduce_scatter_skipped_local), GRADS)

    def test_garbage_from_one_rank_in_the_all_gather_is_caught(self):
        # Only rank 0 tampers; every rank still joins every collective.
        if self.rank == 0:
            self._assert_caught(lambda: patch_all_gather(all_gather_missing_peer_copy), LOSSES)
        else:
            self._assert_caught(lambda: patch_all_gather(passthrough_all_gather), LOSSES)


# -- the wrapper API (reffsdp.FullyShardedDataParallel) ------------------------------------


def all_reduce_scaled(tensor, op=None, group=None, async_op=False):
    """Wrong divide factor in NO_SHARD's all-reduce: the reduced gradient comes back doubled."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    _finished(work)
    tensor.mul_(2)
    return work


def all_reduce_skipped(tensor, op=None, group=None, async_op=False):
    """No all-reduce at all: each rank keeps its own gradient."""


@contextlib.contextmanager
def wrong_wrapper_divide_factor(model) -> Iterator[None]:
    """Every instance's flat reduce divides by 1 (a sum) instead of by the world size."""
    from reffsdp.wrapper.state import states_under

    model.check_is_root()  # lazy init first: it would not undo the setting, but be explicit
    groups = [state.group for state in states_under(model) if state.group is not None]
    for group in groups:
        group.configure(gradient_divide_factor=1.0)
    try:
        yield
    finally:
        for group in groups:
            group.configure(gradient_divide_factor=None)


class TestPlantedBugsWrapper(FSDPTestMultiThread):
    """The same proof for the wrapper API: its parity check rebuilds full parameters and
    gradients from the flat shards, and must catch a broken flat reduction."""

    @property
    def world_size(self) -> int:
        return 2

    def _train(self, patch: Callable[[object], object] | None, strategy=None) -> None:
        from reffsdp import ShardingStrategy
        from reffsdp.testing.build import wrap_blocks
        from reffsdp.testing.models import MLP

        model = init_deterministic(MLPStack(DIM))
        ref_model = copy.deepcopy(model)
        strategy = strategy or ShardingStrategy.FULL_SHARD
        wrapped = wrap_blocks(model, {MLP}, sharding_strategy=strategy)
        context = patch(wrapped) if patch is not None else contextlib.nullcontext()
        with context:
            check_train_parity(self, ref_model, wrapped, _inputs, num_steps=2)

    def _assert_caught(self, patch: Callable[[object], object], stage: str, **kwargs) -> None:
        with self.assertRaises(AssertionError) as caught:
            self._train(patch, **kwargs)
        self.assertIn(f"check_train_parity, {stage}", str(caught.exception))

    def test_unpatched_and_passthrough_runs_pass(self):
        self._train(None)
        self._train(lambda _: passthrough_both())

    def test_wrong_divide_factor_is_caught(self):
        from reffsdp import ShardingStrategy

        self._assert_caught(wrong_wrapper_divide_factor, GRADS)
        self._assert_caught(lambda _: patch_reduce_scatter(reduce_scatter_scaled), GRADS)
        self._assert_caught(
            lambda _: patch_all_reduce(all_reduce_scaled),
            GRADS,
            strategy=ShardingStrategy.NO_SHARD,
        )

    def test_skipped_reduction_is_caught(self):
        from reffsdp import ShardingStrategy

        self._assert_caught(lambda _: patch_reduce_scatter(reduce_scatter_skipped_local), GRADS)
        self._assert_caught(lambda _: patch_reduce_scatter(reduce_scatter_skipped_zeros), GRADS)
        self._assert_caught(
            lambda _: patch_all_reduce(all_reduce_skipped),
            GRADS,
            strategy=ShardingStrategy.NO_SHARD,
        )
