"""Exact collective counts, byte sizes and order of ``fully_shard`` per training step.

The model is N ``fully_shard``-ed blocks under a root that has parameters of its own, so one
iteration has N + 1 parameter groups (SPEC 2.9 "Expected counts"). Expected byte sizes are
computed here from the original parameter shapes, independently of reffsdp's sharding math:
a group's all-gather output (and its reduce-scatter input) holds ``world_size`` padded shards
of ``ceil(dim0 / world_size)`` rows each.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from reffsdp import MixedPrecisionPolicy
from reffsdp.core.comms import Collective
from reffsdp.core.compat import TORCH_VERSION
from reffsdp.testing.build import shard_bottom_up
from reffsdp.testing.comm_counter import CommCounter, all_gather_numel
from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.testing.models import MLP
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.patching import observe_all_gathers, observe_reduce_scatters

AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
NUM_BLOCKS = 3
DIM = 5


class BlocksWithRoot(nn.Module):
    """Blocks of different widths between the root's own ``proj`` (and ``head``) layers.

    Block i widens ``DIM`` by ``i + 2``, so every group has a distinct size and a collective
    can be traced back to its group by its size alone. Without ``head`` the last block's
    output is the root's output, which changes the backward order (see the order test).
    """

    def __init__(self, num_blocks: int = NUM_BLOCKS, with_head: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(MLP(DIM, dim_multiplier=i + 2) for i in range(num_blocks))
        self.head = nn.Linear(DIM, DIM) if with_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def group_shapes(model: BlocksWithRoot) -> dict[str, list[torch.Size]]:
    """Original parameter shapes per group, keyed by the group's module name ("" = root)."""
    shapes = {
        f"layers.{i}": [p.shape for p in layer.parameters()] for i, layer in enumerate(model.layers)
    }
    shapes[""] = [p.shape for name, p in model.named_parameters() if not name.startswith("layers")]
    return shapes


def shard_model(model: BlocksWithRoot, mesh, **fsdp_kwargs) -> BlocksWithRoot:
    return shard_bottom_up(model, model.layers, mesh=mesh, **fsdp_kwargs)


def inputs(rank: int, step: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(2, DIM, generator=generator)


def step_counts(model: nn.Module, x: torch.Tensor) -> tuple[CommCounter, CommCounter]:
    """Counters for one forward and for the backward that follows it."""
    with CommCounter() as forward:
        loss = model(x).sum()
    with CommCounter() as backward:
        loss.backward()
    return forward, backward


class CountsAndBytesChecks:
    def mesh(self):
        return init_device_mesh("cpu", (self.world_size,))

    def check_counts_and_bytes(self, reshard_after_forward):
        n, ws = NUM_BLOCKS, self.world_size
        model = BlocksWithRoot()
        shapes = group_shapes(model)
        shard_model(model, self.mesh(), reshard_after_forward=reshard_after_forward)
        numels = {name: all_gather_numel(s, ws) for name, s in shapes.items()}
        all_bytes = 4 * sum(numels.values())
        block_bytes = 4 * sum(numels[f"layers.{i}"] for i in range(n))
        for step in range(2):
            forward, backward = step_counts(model, inputs(self.rank, step))
            self.assertEqual(forward.get_comm_counts(), {AG: n + 1})
            self.assertEqual(forward.get_comm_bytes(), {AG: all_bytes})
            expected_ag = {None: (n, block_bytes), True: (n + 1, all_bytes), False: (0, 0)}
            count, nbytes = expected_ag[reshard_after_forward]
            self.assertEqual(backward.get_comm_counts()[AG], count)
            self.assertEqual(backward.get_comm_bytes()[AG], nbytes)
            self.assertEqual(backward.get_comm_counts()[RS], n + 1)
            self.assertEqual(backward.get_comm_bytes()[RS], all_bytes)
            self.assertEqual(backward.get_total_counts(), count + n + 1)


@pytest.mark.multithread
class TestCommCountsWorldSize2(CountsAndBytesChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_counts_and_bytes_per_reshard_after_forward(self):
        self.run_subtests(
            {"reshard_after_forward": [None, True, False]}, self.check_counts_and_bytes
        )

    def test_mixed_precision_bf16_halves_all_gather_bytes(self):
        self.run_subtests({"reduce_dtype": [None, torch.float32]}, self._check_bf16_bytes)

    def _check_bf16_bytes(self, reduce_dtype):
        n, ws = NUM_BLOCKS, self.world_size
        model = BlocksWithRoot()
        fp32_bytes = 4 * sum(all_gather_numel(s, ws) for s in group_shapes(model).values())
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        shard_model(model, self.mesh(), reshard_after_forward=True, mp_policy=policy)
        forward, backward = step_counts(model, inputs(self.rank))
        self.assertEqual(forward.get_comm_counts(), {AG: n + 1})
        self.assertEqual(forward.get_comm_bytes()[AG], fp32_bytes // 2)
        self.assertEqual(backward.get_comm_bytes()[AG], fp32_bytes // 2)
        # Unless reduce_dtype says fp32, gradients are reduced as the installed torch's
        # fully_shard does: in the compute dtype (bf16) up to 2.14, in the parameters' dtype
        # (fp32) from 2.15.
        reduced_in_fp32 = reduce_dtype == torch.float32 or TORCH_VERSION >= (2, 15)
        rs_bytes = fp32_bytes if reduced_in_fp32 else fp32_bytes // 2
        self.assertEqual(backward.get_comm_counts()[RS], n + 1)
        self.assertEqual(backward.get_comm_bytes()[RS], rs_bytes)

    def test_no_reduce_scatter_without_gradient_sync(self):
        n = NUM_BLOCKS
        model = shard_model(BlocksWithRoot(), self.mesh())
        model.set_requires_gradient_sync(False)
        for microbatch in range(2):
            forward, backward = step_counts(model, inputs(self.rank, microbatch))
            self.assertEqual(forward.get_comm_counts(), {AG: n + 1})
            self.assertEqual(backward.get_comm_counts(), {AG: n})
        model.set_requires_gradient_sync(True)
        forward, backward = step_counts(model, inputs(self.rank, 2))
        self.assertEqual(forward.get_comm_counts(), {AG: n + 1})
        self.assertEqual(backward.get_comm_counts(), {AG: n, RS: n + 1})

    def test_no_all_gather_after_first_forward_without_resharding(self):
        n = NUM_BLOCKS
        model = shard_model(BlocksWithRoot(), self.mesh())
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
        forward, backward = step_counts(model, inputs(self.rank, 0))
        self.assertEqual(forward.get_comm_counts(), {AG: n + 1})
        self.assertEqual(backward.get_comm_counts(), {RS: n + 1})
        for step in range(1, 3):
            forward, backward = step_counts(model, inputs(self.rank, step))
            self.assertEqual(forward.get_total_counts(), 0)
            self.assertEqual(backward.get_comm_counts(), {RS: n + 1})

    def test_order_of_collectives_in_one_iteration(self):
        """SPEC 3.4 "Observed order" (``reshard_after_forward=True``), via the comms seam.

        With a ``head`` the root's output hook fires first in backward, as in the SPEC's
        transformer. Without one, the last block registered its pre-backward hook on the
        same output tensor before the root did, so it unshards first (torch does the same).
        """
        self.run_subtests({"with_head": [True, False]}, self._check_order)

    def _check_order(self, with_head):
        spec_order = [
            # forward
            "unshard root",
            "unshard layers.0",
            "unshard layers.1",
            "unshard layers.2",
            # backward: each group prefetches the one that ran before it in forward
            "unshard root",
            "unshard layers.2",
            "unshard layers.1",
            "reduce layers.2",
            "unshard layers.0",
            "reduce layers.1",
            "reduce layers.0",
            "reduce root",  # the root's inputs need no grad: the final callback reduces it
        ]
        headless_order = [*spec_order[:4], *spec_order[5:7], "unshard root", *spec_order[7:]]
        expected = spec_order if with_head else headless_order
        model = BlocksWithRoot(with_head=with_head)
        shapes = group_shapes(model)
        shard_model(model, self.mesh(), reshard_after_forward=True)
        ws = self.world_size
        name_of = {all_gather_numel(s, ws): name or "root" for name, s in shapes.items()}
        events: list[str] = []

        def all_gather(output, input, group):
            events.append(f"unshard {name_of[output.numel()]}")

        def reduce_scatter(output, input, op, group):
            events.append(f"reduce {name_of[input.numel()]}")

        with observe_all_gathers(all_gather), observe_reduce_scatters(reduce_scatter):
            model(inputs(self.rank)).sum().backward()
        self.assertEqual(events, expected)


@pytest.mark.multithread
class TestCommCountsWorldSize4(CountsAndBytesChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_counts_and_bytes(self):
        self.run_subtests(
            {"reshard_after_forward": [None, True, False]}, self.check_counts_and_bytes
        )

    def test_int_reshard_after_forward_gathers_over_two_ranks_in_backward(self):
        """``reshard_after_forward=2``: backward all-gathers run over 2-rank groups.

        Each rank keeps half of the padded unsharded parameters after forward (instead of a
        quarter), so a backward all-gather sends twice the forward's input and receives the
        same output, from one peer instead of three.
        """
        n, ws = NUM_BLOCKS, self.world_size
        model = BlocksWithRoot()
        shapes = group_shapes(model)
        mesh = init_device_mesh("cpu", (ws,))
        shard_model(model, mesh, reshard_after_forward=2)
        # (group size, input bytes, output bytes) of each all-gather, in issue order
        calls: list[tuple[int, int, int]] = []

        def all_gather(output, input, group):
            calls.append((group.size(), input.nbytes, output.nbytes))

        with observe_all_gathers(all_gather):
            forward, backward = step_counts(model, inputs(self.rank))
        self.assertEqual(forward.get_comm_counts(), {AG: n + 1})
        self.assertEqual(backward.get_comm_counts(), {AG: n + 1, RS: n + 1})
        self.assertEqual(forward.get_comm_bytes()[AG], backward.get_comm_bytes()[AG])
        group_bytes = sorted(4 * all_gather_numel(s, ws) for s in shapes.values())
        forward_calls, backward_calls = calls[: n + 1], calls[n + 1 :]
        self.assertEqual(sorted(out for _, _, out in forward_calls), group_bytes)
        self.assertEqual(sorted(out for _, _, out in backward_calls), group_bytes)
        for size, inp, out in forward_calls:
            self.assertEqual((size, inp), (4, out // 4))
        for size, inp, out in backward_calls:
            self.assertEqual((size, inp), (2, out // 2))


@pytest.mark.multithread
class TestCommCountsWorldSize1(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 1

    def test_no_collectives(self):
        self.run_subtests({"reshard_after_forward": [None, True, False]}, self._check)

    def _check(self, reshard_after_forward):
        model = shard_model(
            BlocksWithRoot(),
            init_device_mesh("cpu", (1,)),
            reshard_after_forward=reshard_after_forward,
        )
        for step in range(2):
            forward, backward = step_counts(model, inputs(self.rank, step))
            self.assertEqual(forward.get_total_counts(), 0)
            self.assertEqual(backward.get_total_counts(), 0)
        self.assertTrue(all(p.grad is not None for p in model.parameters()))


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_counts_on_fake_group_at_world_size_64(reshard_after_forward):
    """Dispatched collectives of the fake group are counted; no deprecated names are used."""
    n, ws = NUM_BLOCKS, 64
    with fake_process_group(ws, rank=5):
        model = BlocksWithRoot()
        shapes = group_shapes(model)
        mesh = init_device_mesh("cpu", (ws,))
        shard_model(model, mesh, reshard_after_forward=reshard_after_forward)
        all_bytes = 4 * sum(all_gather_numel(s, ws) for s in shapes.values())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            forward, backward = step_counts(model, torch.randn(2, DIM))
        assert forward.get_comm_counts() == {AG: n + 1}
        assert forward.get_comm_bytes() == {AG: all_bytes}
        expected_ag = {None: n, True: n + 1, False: 0}[reshard_after_forward]
        assert backward.get_comm_counts()[AG] == expected_ag
        assert backward.get_comm_counts()[RS] == n + 1
        assert backward.get_comm_bytes()[RS] == all_bytes
        deprecated = [
            str(w.message)
            for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning))
            and (
                "all_gather_into_tensor" in str(w.message)
                or "reduce_scatter_tensor" in str(w.message)
            )
        ]
        assert deprecated == []
