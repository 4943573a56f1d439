"""The wrapper API communicates exactly like torch's ``FullyShardedDataParallel``.

Both wrap the same model (``MLPBlocks``: the root's ``proj`` and three blocks of distinct
widths, ``ModuleWrapPolicy({MLP})``) on the same threaded group and run two iterations;
per iteration we compare, phase by phase (forward, backward), the collectives each issues:
kinds, counts and byte sizes, and without forward prefetch their order too. Torch's wrapper
runs on CPU with ``device_id=torch.device("cpu")``.

[Note: forward prefetch and backward order]
With ``forward_prefetch=True`` torch builds a block's parameter views when its prefetched
all-gather lands, that is before the previous block's forward runs; autograd then schedules
that block's gradient accumulation after the previous block's pre-backward hook, so torch's
second iteration issues the previous block's all-gather before this block's reduce-scatter.
reffsdp builds the views in the block's own pre-forward: the same collectives, the reduce
one step earlier. Only the order differs there, so it is compared as counts and bytes.

[Note: hybrid all-reduce order]
Torch's hybrid strategies all-reduce an instance's reduced shard across replicas right
after its reduce-scatter. The shared core keeps one reduction in flight and issues its
all-reduce when it completes it, at the next instance's reduction (or the final callback):
the same all-reduces, each one collective later. Compared as counts and bytes.

The expected figures are also written out per strategy (two ranks, fp32; the flat sizes
are padded to an even numel): every all-gather and reduce-scatter moves exactly the padded
flat parameter of its instance, the analytic minimum.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

from reffsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from reffsdp.core import comms, compat
from reffsdp.core.comms import Collective
from reffsdp.testing.build import wrap_blocks
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.models import MLP, MLPBlocks, init_deterministic
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread

AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE
S = ShardingStrategy
DIM = 5
MULTIPLIERS = (2, 3, 4)  # block i has 2 * DIM * m * DIM + m * DIM + DIM parameters


def model() -> MLPBlocks:
    torch.manual_seed(0)
    return MLPBlocks(DIM, MULTIPLIERS)


def flat_numels(shard_size: int) -> list[int]:
    """Each instance's flat parameter padded to a multiple of ``shard_size``, root first.

    Computed from the module shapes alone (no reffsdp layout math): concatenate, then pad
    the total so that it splits into ``shard_size`` equal chunks.
    """
    m = model()
    groups = [[m.proj], *[[layer] for layer in m.layers]]
    numels = [sum(p.numel() for g in group for p in g.parameters()) for group in groups]
    return [-(-n // shard_size) * shard_size for n in numels]


def run_iterations(wrapped, rank: int, no_sync: bool = False) -> list[tuple[list, list]]:
    """Per iteration, the (forward, backward) collective sequences: two iterations, or with
    ``no_sync`` three microbatches of which the first two run inside ``no_sync()``."""
    phases = []
    steps = 3 if no_sync else 2
    for step in range(steps):
        x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        inside = no_sync and step < steps - 1
        with wrapped.no_sync() if inside else contextlib.nullcontext():
            with CommCounter() as forward:
                loss = wrapped(x).sum()
            with CommCounter() as backward:
                loss.backward()
        phases.append((forward.get_comm_sequence(), backward.get_comm_sequence()))
    return phases


def counts_and_bytes(sequence: list) -> tuple[Counter, Counter]:
    counts, nbytes = Counter(), Counter()
    for kind, size in sequence:
        counts[kind] += 1
        nbytes[kind] += size
    return counts, nbytes


def bf16_policy(policy_cls, reduce_fp32: bool):
    reduce_dtype = torch.float32 if reduce_fp32 else None
    return policy_cls(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)


class WrapperCommChecks:
    def torch_phases(
        self, strategy, backward_prefetch, forward_prefetch, mesh_kwargs, bf16=None, no_sync=False
    ):
        torch_strategy = TorchShardingStrategy[strategy.name]
        torch_prefetch = (
            TorchBackwardPrefetch[backward_prefetch.name] if backward_prefetch else None
        )
        wrapped = TorchFSDP(
            model(),
            auto_wrap_policy=TorchModuleWrapPolicy({MLP}),
            sharding_strategy=torch_strategy,
            backward_prefetch=torch_prefetch,
            forward_prefetch=forward_prefetch,
            device_id=torch.device("cpu"),
            mixed_precision=bf16_policy(TorchMixedPrecision, bf16) if bf16 is not None else None,
            **mesh_kwargs,
        )
        return run_iterations(wrapped, self.rank, no_sync)

    def ref_phases(
        self, strategy, backward_prefetch, forward_prefetch, mesh_kwargs, bf16=None, no_sync=False
    ):
        wrapped = wrap_blocks(
            model(),
            {MLP},
            sharding_strategy=strategy,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            mixed_precision=bf16_policy(MixedPrecision, bf16) if bf16 is not None else None,
            **mesh_kwargs,
        )
        self.assertEqual(len(FullyShardedDataParallel.fsdp_modules(wrapped)), 4)
        return run_iterations(wrapped, self.rank, no_sync)

    def check_like_torch(
        self,
        strategy,
        backward_prefetch,
        forward_prefetch,
        mesh_kwargs=None,
        bf16=None,
        no_sync=False,
    ):
        """``bf16``: None for fp32, else bf16 compute reducing in fp32 (True) or bf16."""
        args = (strategy, backward_prefetch, forward_prefetch, mesh_kwargs or {}, bf16, no_sync)
        expected, actual = self.torch_phases(*args), self.ref_phases(*args)
        # See [Note: forward prefetch and backward order] and [Note: hybrid all-reduce order].
        same_order = not forward_prefetch and strategy not in (
            S.HYBRID_SHARD,
            S._HYBRID_SHARD_ZERO2,
        )
        for step, (want, got) in enumerate(zip(expected, actual)):
            for phase, want_seq, got_seq in zip(("forward", "backward"), want, got):
                where = f"step {step} {phase}"
                if not same_order:
                    self.assertEqual(counts_and_bytes(got_seq), counts_and_bytes(want_seq), where)
                else:
                    self.assertEqual(got_seq, want_seq, where)
        return actual


class TestWrapperCommCounts(WrapperCommChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_like_torch_per_strategy_and_prefetch(self):
        self.run_subtests(
            {
                "strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD],
                "backward_prefetch": [
                    None,
                    BackwardPrefetch.BACKWARD_PRE,
                    BackwardPrefetch.BACKWARD_POST,
                ],
                "forward_prefetch": [False, True],
            },
            self.check_like_torch,
        )

    def test_like_torch_with_mixed_precision_and_no_sync(self):
        self.run_subtests(
            {
                "strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD],
                "backward_prefetch": [BackwardPrefetch.BACKWARD_PRE],
                "forward_prefetch": [False],
                "bf16": [None, False, True],
                "no_sync": [False, True],
            },
            self.check_like_torch,
        )

    def test_counts_and_bytes_are_the_analytic_minimum(self):
        """SPEC 2.13: the figures per strategy, written out (fp32, 4 bytes per element)."""
        n = len(MULTIPLIERS)
        numels = flat_numels(self.world_size)  # root first
        all_bytes = 4 * sum(numels)
        block_bytes = 4 * sum(numels[1:])
        unpadded = flat_numels(1)
        expected = {
            # forward AG (count, bytes), backward AG, backward RS, backward AR
            S.FULL_SHARD: ((n + 1, all_bytes), (n, block_bytes), (n + 1, all_bytes), (0, 0)),
            S.SHARD_GRAD_OP: ((n + 1, all_bytes), (0, 0), (n + 1, all_bytes), (0, 0)),
            S.NO_SHARD: ((0, 0), (0, 0), (0, 0), (n + 1, 4 * sum(unpadded))),
        }
        for strategy, (fwd_ag, bwd_ag, bwd_rs, bwd_ar) in expected.items():
            for forward, backward in self.ref_phases(
                strategy, BackwardPrefetch.BACKWARD_PRE, False, {}
            ):
                f_counts, f_bytes = counts_and_bytes(forward)
                b_counts, b_bytes = counts_and_bytes(backward)
                self.assertEqual((f_counts[AG], f_bytes[AG]), fwd_ag, strategy)
                self.assertEqual(sum(f_counts.values()), fwd_ag[0], strategy)
                self.assertEqual((b_counts[AG], b_bytes[AG]), bwd_ag, strategy)
                self.assertEqual((b_counts[RS], b_bytes[RS]), bwd_rs, strategy)
                self.assertEqual((b_counts[AR], b_bytes[AR]), bwd_ar, strategy)
                self.assertEqual(sum(b_counts.values()), bwd_ag[0] + bwd_rs[0] + bwd_ar[0])


class TestWrapperHybridCommCounts(WrapperCommChecks, FSDPTestMultiThread):
    """HYBRID_SHARD / _HYBRID_SHARD_ZERO2 on 2 x 2 ranks: gathers and reduce-scatters in the
    shard group, one all-reduce per instance across the replicas."""

    @property
    def world_size(self) -> int:
        return 4

    def test_like_torch_hybrid(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        self.run_subtests(
            {
                "strategy": [S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2],
                "backward_prefetch": [None, BackwardPrefetch.BACKWARD_PRE],
                "forward_prefetch": [False],
                "mesh_kwargs": [{"device_mesh": mesh}],
            },
            self.check_like_torch,
        )
        n = len(MULTIPLIERS)
        numels = flat_numels(2)
        for strategy in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2):
            for _, backward in self.ref_phases(strategy, None, False, {"device_mesh": mesh}):
                counts, nbytes = counts_and_bytes(backward)
                self.assertEqual((counts[RS], nbytes[RS]), (n + 1, 4 * sum(numels)))
                # The all-reduce moves each reduced shard: half of each padded flat size.
                self.assertEqual((counts[AR], nbytes[AR]), (n + 1, 4 * sum(numels) // 2))
        dist.barrier()


class TestWrapperGradientsLikeTorch(FSDPTestMultiThread):
    """On 3 ranks the reduced gradients equal torch's wrapper's bit for bit: both divide by
    the pre factor (2), sum, and divide by the post factor (1.5), never AVG. (With a power
    of two ranks the two ways round the same: dividing by 2 is exact.)"""

    @property
    def world_size(self) -> int:
        return 3

    def full_grads(self, wrapped, summon) -> dict[str, torch.Tensor]:
        x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(self.rank))
        wrapped(x).sum().backward()
        with summon(wrapped, with_grads=True):
            return {
                name.replace("_fsdp_wrapped_module.", ""): p.grad.clone()
                for name, p in wrapped.named_parameters()
            }

    def test_full_shard_gradients_equal_torchs(self):
        # The same values on every rank and in both models (threads share the global RNG).
        theirs = TorchFSDP(
            init_deterministic(model()),
            auto_wrap_policy=TorchModuleWrapPolicy({MLP}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        ours = wrap_blocks(init_deterministic(model()), {MLP}, use_orig_params=True)
        expected = self.full_grads(theirs, TorchFSDP.summon_full_params)
        ops = []

        def record_op(output, input, group=None, op=dist.ReduceOp.SUM, async_op=False):
            ops.append(op)
            return reduce_scatter(output, input, group=group, op=op, async_op=async_op)

        reduce_scatter = compat.reduce_scatter_single()
        with comms.intercept(RS, record_op):
            actual = self.full_grads(ours, FullyShardedDataParallel.summon_full_params)
        self.assertEqual(ops, [dist.ReduceOp.SUM] * 4)  # one per instance, as torch's
        self.assertEqual(sorted(actual), sorted(expected))
        for name, grad in expected.items():
            self.assertTrue(torch.equal(actual[name], grad), name)
