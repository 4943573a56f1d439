"""``reffsdp.FullyShardedDataParallel`` (the wrapper API) trains exactly like DDP.

Every test wraps a small stack nested (``auto_wrap_policy=ModuleWrapPolicy({MLP})``: each
block is an instance, the root holds ``proj``), copies it first as the reference and runs
:func:`check_train_parity`, which rebuilds each original parameter and gradient from the
flat shards (see [Note: unflattening for a check] in ``reffsdp.testing.parity``) and compares
them with a DDP copy at every step.

Mixed precision compares against ``LowPrecisionCompute`` (see [Note: a fair mixed-precision
reference] in ``test_fully_shard_mixed_precision.py``), with ``reduce_dtype=float32`` so
both sides average in fp32.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from reffsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from reffsdp.core.comms import Collective
from reffsdp.testing.build import reference_and_model, wrap_blocks
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPBlocks, init_deterministic
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import (
    LowPrecisionCompute,
    Passthrough,
    check_train_parity,
    unflattened_params,
)

pytestmark = pytest.mark.multithread

DIM = 5  # 3 * 5 and 4 * 5 rows: flat sizes that need padding on 2 and 4 ranks
make_inputs = random_inputs(3, DIM)

S = ShardingStrategy
AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE
FP32, BF16, FP16, OFFLOAD = "fp32", "bf16", "fp16", "offload"


def blocks_model() -> MLPBlocks:
    """Two MLP blocks with buffers under a root with ``proj``; ReLUs kept alive."""
    return init_deterministic(MLPBlocks(DIM, with_buffer=True))


def precision_kwargs(precision: str) -> dict:
    if precision == OFFLOAD:
        return {"cpu_offload": CPUOffload(offload_params=True)}
    if precision in (BF16, FP16):
        dtype = torch.bfloat16 if precision == BF16 else torch.float16
        policy = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)
        return {"mixed_precision": policy}
    return {}


class WrapperTrainChecks:
    """Test bodies the gloo suite runs too (``tests/multiprocess/test_wrapper_gloo.py``)."""

    def check_parity(self, strategy, precision, use_orig_params, mesh_kwargs=None, **kwargs):
        ref_model, model = reference_and_model(blocks_model())
        wrapper_kwargs = precision_kwargs(precision)
        wrapped = wrap_blocks(
            model,
            {MLP},
            sharding_strategy=strategy,
            use_orig_params=use_orig_params,
            **(mesh_kwargs or {}),
            **wrapper_kwargs,
            **kwargs,
        )
        instances = FullyShardedDataParallel.fsdp_modules(wrapped)
        self.assertEqual(len(instances), 3)
        if "mixed_precision" in wrapper_kwargs:
            dtype = wrapper_kwargs["mixed_precision"].param_dtype
            ref_model = LowPrecisionCompute(ref_model, dtype, buffer_dtype=dtype)
            wrapped = Passthrough(wrapped)
        check_train_parity(self, ref_model, wrapped, make_inputs, num_steps=2)
        for instance in instances:  # the optimizer only ever saw fp32 shards and grads
            for param in instance.parameters(recurse=False):
                self.assertEqual(param.dtype, torch.float32)

    def check_no_sync(self, strategy, use_orig_params, num_microbatches=3):
        ref_model, model = reference_and_model(blocks_model())
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        counts = []

        def counted_no_sync(module):
            counter = CommCounter()
            counts.append(counter)
            stack = contextlib.ExitStack()
            stack.enter_context(module.no_sync())
            stack.enter_context(counter)
            return stack

        check_train_parity(
            self,
            ref_model,
            wrapped,
            make_inputs,
            num_steps=2,
            num_microbatches=num_microbatches,
            no_sync=counted_no_sync,
        )
        self.assertEqual(len(counts), 2 * (num_microbatches - 1))
        reductions = [c.get_comm_counts()[kind] for c in counts for kind in (RS, AR)]
        self.assertEqual(sum(reductions), 0, "a gradient reduction inside no_sync")
        # Per microbatch inside no_sync: FULL_SHARD gathers every block in forward and again
        # in backward; SHARD_GRAD_OP keeps what it gathered until the synced backward;
        # NO_SHARD never gathers.
        first, later = {
            S.FULL_SHARD: (5, 5),
            S.SHARD_GRAD_OP: (3, 0),
            S.NO_SHARD: (0, 0),
        }[strategy]
        expected = ([first] + [later] * (num_microbatches - 2)) * 2
        self.assertEqual([c.get_comm_counts()[AG] for c in counts], expected)


class TestWrapperTraining(WrapperTrainChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_parity_per_strategy_and_precision(self):
        self.run_subtests(
            {
                "strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD],
                "precision": [FP32, BF16, FP16, OFFLOAD],
                "use_orig_params": [False, True],
            },
            self.check_parity,
        )

    def test_no_sync_equals_one_big_batch(self):
        self.run_subtests(
            {
                "strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD],
                "use_orig_params": [False, True],
            },
            self.check_no_sync,
        )


class TestWrapperHybridTraining(WrapperTrainChecks, FSDPTestMultiThread):
    """HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 2 x 2 ranks: shard within {0, 1} and {2, 3},
    all-reduce across {0, 2} and {1, 3}."""

    @property
    def world_size(self) -> int:
        return 4

    def hybrid_kwargs(self, how: str) -> dict:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        if how == "device_mesh":
            return {"device_mesh": mesh}
        return {"process_group": (mesh.get_group("shard"), mesh.get_group("replicate"))}

    def test_parity_per_strategy_and_precision(self):
        self.run_subtests(
            {
                "strategy": [S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2],
                "precision": [FP32, BF16, OFFLOAD],
                "use_orig_params": [False, True],
                "how": ["device_mesh", "process_groups"],
            },
            lambda how, **kwargs: self.check_parity(mesh_kwargs=self.hybrid_kwargs(how), **kwargs),
        )
