"""Sharded blocks under ``torch.compile`` (inductor, CPU) train like the unsharded model.

Users compile their blocks in one of two ways, then shard them:

* ``model.blocks[i] = torch.compile(block)``: only the block's forward is compiled;
* ``block.compile()``: the block's whole ``__call__`` is compiled, FSDP's hooks included.

Either way FSDP's own work must stay out of the graphs (see [Note: FSDP work runs outside
compiled graphs] in ``reffsdp/core/compile_support.py``): each block gives one forward graph,
compiled on the first step, and no step after it compiles again. The same models run under
torch's ``fully_shard`` and ``FullyShardedDataParallel`` must not compile fewer graphs.

Each rank runs in its own process (gloo): ``torch.compile`` is not thread-safe (dynamo and
inductor keep process-wide state, such as the config that ``config.patch`` changes), so ranks
that share a process, as on the threaded harness, can compile with another rank's settings,
give wrong results or crash the process.

Compiling dominates these tests, so the models are tiny, each test covers many settings in
one run, and dynamo's caches are reset only between models (inductor's cache of compiled
graphs is kept: identical graphs compile once).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from reffsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard
from reffsdp import ShardingStrategy as S
from reffsdp.testing.build import reference_and_model
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.parity import LowPrecisionCompute, Passthrough, check_train_parity
from reffsdp.wrap import ModuleWrapPolicy

pytestmark = [pytest.mark.multiprocess, pytest.mark.compile]

DIM = 8


class Block(nn.Module):
    """A residual MLP; with ``checkpointed`` its activations are recomputed in backward.

    GELU, not ReLU: compiled code may round a bf16 value differently from eager code, and at
    a pre-activation near zero that flips a ReLU's gate, a large change of the gradient.
    """

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, 2 * DIM)
        self.out_proj = nn.Linear(2 * DIM, DIM)
        self.checkpointed = checkpointed

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(nn.functional.gelu(self.in_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


class Net(nn.Module):
    """Two blocks and a head that only the root shards."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(checkpointed), Block(checkpointed)])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mean_square_loss(output: torch.Tensor) -> torch.Tensor:
    """A loss of positive terms: a sum of outputs can cancel to near zero, where one bf16
    rounding step of one output is a large relative change."""
    return output.float().pow(2).mean()


def make_inputs(iteration: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * iteration + rank)
    return torch.randn(4, DIM, generator=generator)


def compile_blocks(model: Net, style: str) -> None:
    """Compile each block: ``"module"``, ``torch.compile(block)``; ``"in_place"``,
    ``block.compile()``; ``"whole_model"`` compiles none (the sharded root is compiled)."""
    if style == "whole_model":
        return
    for i, block in enumerate(model.blocks):
        if style == "module":
            model.blocks[i] = torch.compile(block)
        else:
            block.compile()


@contextlib.contextmanager
def low_precision_rounding() -> Iterator[None]:
    """Inductor rounds bf16 results like eager does, so parity stays tight in bf16."""
    config = torch._inductor.config
    if not hasattr(config, "emulate_precision_casts"):
        yield
        return
    with config.patch(emulate_precision_casts=True):
        yield


class CompileChecks:
    """Test bodies; see the module docstring."""

    def fresh_compile_caches(self) -> None:
        """Leave the last model's compiled code behind before building a new one."""
        torch._dynamo.reset()
        counters.clear()

    def compile_counts(self) -> dict[str, int]:
        return {
            "graphs": counters["stats"]["unique_graphs"],
            "frames": counters["frames"]["total"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }

    def shard(self, model: Net, api: str, precision: torch.dtype, reshard: bool) -> nn.Module:
        if api == "fully_shard":
            mp_policy = MixedPrecisionPolicy(param_dtype=precision, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, reshard_after_forward=reshard, mp_policy=mp_policy)
            return fully_shard(model, reshard_after_forward=reshard, mp_policy=mp_policy)
        return FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=S.FULL_SHARD if reshard else S.SHARD_GRAD_OP,
            mixed_precision=MixedPrecision(param_dtype=precision, reduce_dtype=torch.float32),
            use_orig_params=True,
        )

    def check_parity(
        self, api: str, style: str, precision: torch.dtype, reshard: bool, checkpointed=False
    ) -> dict[str, int]:
        """Train 3 steps against the unsharded, uncompiled model; return the compile counts
        after the first step, checking the later steps compiled nothing."""
        self.fresh_compile_caches()
        ref_model, model = reference_and_model(Net(checkpointed))
        compile_blocks(model, style)
        sharded = self.shard(model, api, precision, reshard)
        if style == "whole_model":
            sharded = torch.compile(sharded)
        if precision != torch.float32:
            ref_model = LowPrecisionCompute(ref_model, precision)
            sharded = Passthrough(sharded)
        # Inductor fuses and reorders fp32 arithmetic, so results match eager to rounding.
        tolerance = 1e-5 if precision == torch.float32 else 1e-2
        train = functools.partial(
            check_train_parity,
            self,
            ref_model,
            sharded,
            make_inputs,
            loss_fn=mean_square_loss,
            prefixes_to_ignore=("_orig_mod.",),  # what torch.compile(block) adds
            rtol=tolerance,
            atol=tolerance,
        )
        with low_precision_rounding():
            train(num_steps=1)
            first = self.compile_counts()
            train(num_steps=2)
        self.assertEqual(self.compile_counts(), first, "compiled again after the first step")
        self.assertGreater(first["graphs"], 0, "nothing was compiled")
        if style != "whole_model":  # there the graph breaks at every FSDP hook
            self.assertEqual(first["graph_breaks"], 0)
        return first

    def compile_counts_of_torch(self, api: str, style: str) -> dict[str, int]:
        """The counts after one step of the same model under torch's FSDP."""
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchWrapPolicy

        self.fresh_compile_caches()
        _, model = reference_and_model(Net())
        compile_blocks(model, style)
        if api == "fully_shard":
            for block in model.blocks:
                torch_fully_shard(block)
            torch_fully_shard(model)
        else:
            model = TorchFSDP(
                model,
                auto_wrap_policy=TorchWrapPolicy({Block}),
                use_orig_params=True,
                device_id=torch.device("cpu"),
            )
        model(make_inputs(0, self.rank)).sum().backward()
        return self.compile_counts()

    def check_compiles_as_torch(self, api: str, style: str) -> None:
        ours = self.check_parity(api, style, torch.float32, reshard=True)
        theirs = self.compile_counts_of_torch(api, style)
        self.assertEqual(ours["graphs"], theirs["graphs"])  # one per block
        # Torch's hooks take more frames (its disabling wrapper is itself a frame).
        self.assertLessEqual(ours["frames"], theirs["frames"])
        self.assertLessEqual(ours["graph_breaks"], theirs["graph_breaks"])


class TestCompile(CompileChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_parity_per_style_api_precision_and_resharding(self):
        self.run_subtests(
            {
                "api": ["fully_shard", "wrapper"],
                "style": ["module", "in_place"],
                "precision": [torch.float32, torch.bfloat16],
                "reshard": [True, False],
            },
            self.check_parity,
        )

    def test_compiles_no_more_than_torch(self):
        # Torch's wrapper bypasses blocks compiled as torch.compile(block) before auto
        # wrapping (the compiled module keeps calling the unwrapped block); reffsdp does not.
        self.run_subtests(
            {"api": ["fully_shard"], "style": ["module", "in_place"]},
            self.check_compiles_as_torch,
        )
        self.check_compiles_as_torch("wrapper", "in_place")

    def test_activation_checkpointing_inside_compiled_blocks(self):
        self.run_subtests(
            {"api": ["fully_shard", "wrapper"], "style": ["module", "in_place"]},
            self.check_parity,
            precision=torch.float32,
            reshard=True,
            checkpointed=True,
        )

    def test_whole_sharded_model_compiled(self):
        # Dynamo stops at each FSDP hook and compiles the code between them: each block's
        # forward still becomes one graph.
        self.run_subtests(
            {"api": ["fully_shard", "wrapper"]},
            self.check_parity,
            style="whole_model",
            precision=torch.float32,
            reshard=True,
        )
