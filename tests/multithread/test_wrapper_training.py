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
import copy
import itertools
import os
import warnings

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
from reffsdp.wrapper.state import states_under

pytestmark = pytest.mark.multithread

DIM = 5  # 3 * 5 and 4 * 5 rows: flat sizes that need padding on 2 and 4 ranks
make_inputs = random_inputs(3, DIM)

S = ShardingStrategy
AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE
FP32, BF16, FP16, OFFLOAD = "fp32", "bf16", "fp16", "offload"


def blocks_model() -> MLPBlocks:
    """Two MLP blocks with buffers under a root with ``proj``; ReLUs kept alive."""
    return init_deterministic(MLPBlocks(DIM, with_buffer=True))


def blocks_wrapped_by(api: str, strategy: ShardingStrategy, **kwargs) -> nn.Module:
    """:func:`blocks_model` wrapped, an instance per MLP block, by ``api``'s wrapper:
    ``"reffsdp"`` or ``"torch"`` (the reference, told the CPU device it needs)."""
    if api == "reffsdp":
        return wrap_blocks(blocks_model(), {MLP}, sharding_strategy=strategy, **kwargs)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    return TorchFSDP(
        blocks_model(),
        auto_wrap_policy=TorchPolicy({MLP}),
        sharding_strategy=TorchStrategy[strategy.name],
        device_id=torch.device("cpu"),
        **kwargs,
    )


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

    def test_original_parameters_between_forward_and_backward(self):
        """``use_orig_params=True``: after forward, FULL_SHARD shows 1-D shard parameters,
        the root included (it keeps its gathered buffer, not its views); SHARD_GRAD_OP keeps
        the full-size views it computed with. As torch does."""
        for strategy, root_shape in ((S.FULL_SHARD, None), (S.SHARD_GRAD_OP, (DIM, DIM))):
            model = blocks_model()
            wrapped = wrap_blocks(model, {MLP}, sharding_strategy=strategy, use_orig_params=True)
            loss = wrapped(make_inputs(0, self.rank)).sum()
            if root_shape is None:
                self.assertIsInstance(model.proj.weight, nn.Parameter)
                self.assertEqual(model.proj.weight.dim(), 1)
                self.assertEqual(model.layers[0].in_proj.weight.dim(), 1)
            else:
                self.assertEqual(tuple(model.proj.weight.shape), root_shape)
                self.assertEqual(model.layers[0].in_proj.weight.dim(), 2)
            # named_parameters() lists every original parameter, at the shape shown.
            shown = dict(wrapped.named_parameters())
            self.assertEqual(len(shown), len(list(blocks_model().parameters())))
            self.assertEqual(
                shown["_fsdp_wrapped_module.proj.weight"].shape, model.proj.weight.shape
            )
            loss.backward()
            self.assertEqual(model.proj.weight.dim(), 1)
            self.assertEqual(model.proj.weight.grad.shape, model.proj.weight.shape)

    def test_original_parameters_after_a_forward_without_grad(self):
        """No backward follows: every strategy shows 1-D shard parameters, as torch's."""
        for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD):
            shapes = []
            for api in ("reffsdp", "torch"):
                wrapped = blocks_wrapped_by(api, strategy, use_orig_params=True)
                with torch.no_grad():
                    wrapped(make_inputs(0, self.rank))
                shapes.append([tuple(p.shape) for p in wrapped.parameters()])
            self.assertEqual(shapes[0], shapes[1], strategy)

    def test_no_shard_originals_keep_their_shapes_like_torch(self):
        """NO_SHARD, use_orig_params=True: parameters and gradients at their own shapes
        before, during and after a step (each rank holds every parameter whole)."""
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

        seen = []
        for wrapped in (
            FullyShardedDataParallel(
                blocks_model(), sharding_strategy=S.NO_SHARD, use_orig_params=True
            ),
            TorchFSDP(
                blocks_model(),
                sharding_strategy=TorchStrategy.NO_SHARD,
                use_orig_params=True,
                device_id=torch.device("cpu"),
            ),
        ):
            before = [tuple(p.shape) for p in wrapped.parameters()]
            loss = wrapped(make_inputs(0, self.rank)).sum()
            during = [tuple(p.shape) for p in wrapped.parameters()]
            loss.backward()
            after = [tuple(p.shape) for p in wrapped.parameters()]
            grads = [tuple(p.grad.shape) for p in wrapped.parameters()]
            seen.append((before, during, after, grads))
        self.assertEqual(seen[0], seen[1])
        self.assertEqual(seen[0][0], [tuple(p.shape) for p in blocks_model().parameters()])

    def test_accumulate_with_sync(self):
        """Two synced backwards per step add their reduced gradients (no ``no_sync``)."""
        self.run_subtests(
            {
                "strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD],
                "use_orig_params": [False, True],
            },
            self._check_accumulate_with_sync,
        )

    def _check_accumulate_with_sync(self, strategy, use_orig_params):
        ref_model, model = reference_and_model(blocks_model())
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        check_train_parity(self, ref_model, wrapped, make_inputs, num_steps=2, num_microbatches=2)


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

    def test_children_share_the_roots_groups(self):
        """Auto-wrapped children all-gather and all-reduce on the root's groups, however the
        root got them (none given: a mesh is built once, not once per child)."""

        def check(how):
            kwargs = self.hybrid_kwargs(how) if how else {}
            model = wrap_blocks(MLPBlocks(DIM), {MLP}, sharding_strategy=S.HYBRID_SHARD, **kwargs)
            infos = [state.mesh_info for state in states_under(model)]
            self.assertGreater(len(infos), 1)
            for info in infos[1:]:
                self.assertIs(info.shard_group, infos[0].shard_group)
                self.assertIs(info.replicate_group, infos[0].replicate_group)

        self.run_subtests({"how": [None, "device_mesh", "process_groups"]}, check)


def _seeded_init(module: nn.Module) -> None:
    """A ``param_init_fn``: real storage, then values that depend only on the module's
    shapes (the same on every rank without a collective)."""
    module.to_empty(device="cpu", recurse=False)
    generator = torch.Generator().manual_seed(sum(t.numel() for t in module.parameters(False)))
    with torch.no_grad():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5 + 0.1)


def _reference_from(wrapped: nn.Module) -> MLPBlocks:
    """An unsharded ``MLPBlocks`` holding what ``wrapped`` holds (parameters and buffers)."""
    ref_model = MLPBlocks(DIM, with_buffer=True)
    params = {name: p.detach().clone() for name, (p, _) in unflattened_params(wrapped).items()}
    buffers = {
        name.replace("_fsdp_wrapped_module.", ""): b.detach().clone()
        for name, b in wrapped.named_buffers()
    }
    ref_model.load_state_dict({**params, **buffers})
    return ref_model


class TestWrapperFeatures(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_meta_device_init_with_param_init_fn(self):
        with torch.device("meta"):
            model = MLPBlocks(DIM, with_buffer=True)
        ref_model = MLPBlocks(DIM, with_buffer=True)
        for module in ref_model.modules():
            _seeded_init(module)
        wrapped = wrap_blocks(model, {MLP}, param_init_fn=_seeded_init, use_orig_params=True)
        self.assertFalse(any(t.is_meta for t in [*wrapped.parameters(), *wrapped.buffers()]))
        check_train_parity(self, ref_model, wrapped, make_inputs, num_steps=2)

    def test_meta_device_init_with_reset_parameters_and_sync_module_states(self):
        with torch.device("meta"):
            model = MLPBlocks(DIM, with_buffer=True)
        # Each rank draws its own values (the ranks share one RNG); rank 0's win.
        wrapped = wrap_blocks(model, {MLP}, sync_module_states=True)
        self.assertFalse(any(t.is_meta for t in [*wrapped.parameters(), *wrapped.buffers()]))
        full = unflattened_params(wrapped)
        for name, (param, _) in full.items():
            self.assertTrue(param.isfinite().all(), name)
            self.assertGreater(param.abs().sum().item(), 0.0, name)  # reset, not left empty
        check_train_parity(self, _reference_from(wrapped), wrapped, make_inputs, num_steps=2)

    def test_meta_device_module_without_reset_parameters_raises_like_torch(self):
        """Its buffer would be left uninitialized: torch's and ours raise AttributeError."""
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        class Shifted(nn.Module):  # a buffer, no reset_parameters()
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("shift", torch.ones(DIM))

        for wrap, extra in (
            (FullyShardedDataParallel, {}),
            (TorchFSDP, {"device_id": torch.device("cpu")}),
        ):
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(DIM, DIM), Shifted())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's says it could not reset
                with self.assertRaisesRegex(AttributeError, "reset_parameters"):
                    wrap(model, **extra)

    def test_sync_module_states_takes_rank0s_params_and_buffers(self):
        self.run_subtests(
            {"strategy": [S.FULL_SHARD, S.NO_SHARD], "use_orig_params": [False, True]},
            self._check_sync_module_states,
        )

    def _check_sync_module_states(self, strategy, use_orig_params):
        model = init_deterministic(MLPBlocks(DIM, with_buffer=True), seed=self.rank)
        with torch.no_grad():
            for buffer in model.buffers():
                buffer.fill_(float(self.rank + 1))
        rank0 = copy.deepcopy(model)
        for tensor in [*rank0.parameters(), *rank0.buffers()]:
            dist.broadcast(tensor.data, src=0)
        wrapped = wrap_blocks(
            model,
            {MLP},
            sharding_strategy=strategy,
            use_orig_params=use_orig_params,
            sync_module_states=True,
        )
        full = unflattened_params(wrapped)
        for name, param in rank0.named_parameters():
            torch.testing.assert_close(full[name][0], param, rtol=0, atol=0, msg=name)
        buffers = {n.replace("_fsdp_wrapped_module.", ""): b for n, b in wrapped.named_buffers()}
        for name, buffer in rank0.named_buffers():
            torch.testing.assert_close(buffers[name], buffer, rtol=0, atol=0, msg=name)

    def test_ignored_modules_and_states_stay_local(self):
        self.run_subtests(
            {"how": ["ignored_modules", "ignored_states"], "use_orig_params": [False, True]},
            self._check_ignored,
        )

    def _check_ignored(self, how, use_orig_params):
        _, model = reference_and_model(blocks_model())
        local_model = copy.deepcopy(model)  # no data parallelism: what the block keeps
        ignored = list(model.layers[1].parameters())
        kwargs = (
            {"ignored_modules": [model.layers[1]]}
            if how == "ignored_modules"
            else {"ignored_states": ignored}
        )
        wrapped = wrap_blocks(model, {MLP}, use_orig_params=use_orig_params, **kwargs)
        handles = [i._handle for i in FullyShardedDataParallel.fsdp_modules(wrapped) if i._handle]
        self.assertEqual(len(handles), 2)  # the root's proj, block 0; block 1 is not flattened
        self.assertFalse(any(f.startswith("layers.1.") for h in handles for f in h.fqns))
        self.assertEqual(len(ignored), 4)
        for param in ignored:  # still the block's own full-size parameters
            self.assertIn(param, set(wrapped.parameters()))
        x = make_inputs(0, self.rank)
        with CommCounter() as counter:
            wrapped(x).sum().backward()
        local_model(x).sum().backward()
        flat_numel = sum(h.layout.padded_numel for h in handles)
        self.assertEqual(counter.get_comm_bytes()[RS], 4 * flat_numel)  # never reduced
        for (name, ref_param), param in zip(local_model.layers[1].named_parameters(), ignored):
            torch.testing.assert_close(param.grad, ref_param.grad, msg=name)  # not averaged
        grads = [torch.empty_like(ignored[0].grad) for _ in range(self.world_size)]
        dist.all_gather(grads, ignored[0].grad)
        self.assertFalse(torch.equal(grads[0], grads[1]))  # the ranks' inputs differ

    def test_frozen_and_trainable_mix(self):
        ref_model, model = reference_and_model(blocks_model())
        for module in (ref_model, model):
            module.layers[0].in_proj.requires_grad_(False)
            module.proj.bias.requires_grad_(False)
        wrapped = wrap_blocks(copy.deepcopy(model), {MLP}, use_orig_params=True)
        check_train_parity(self, ref_model, wrapped, make_inputs, num_steps=2)
        for name, (_, grad) in unflattened_params(wrapped).items():
            frozen = name.startswith("layers.0.in_proj") or name == "proj.bias"
            self.assertEqual(grad is None, frozen, name)
        # Torch refuses a mix inside one flat parameter without use_orig_params.
        with self.assertRaisesRegex(ValueError, "requires_grad"):
            wrap_blocks(model, {MLP}, use_orig_params=False)

    def test_optimizer_made_before_wrapping_trains_with_orig_params(self):
        """use_orig_params=True keeps the parameter objects, as torch's wrapper does."""
        model = blocks_model()
        initial = copy.deepcopy(model)
        early = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped = wrap_blocks(model, {MLP}, use_orig_params=True)
        twin = wrap_blocks(copy.deepcopy(initial), {MLP}, use_orig_params=True)
        late = torch.optim.SGD(twin.parameters(), lr=0.1)
        self.assertEqual({id(p) for p in wrapped.parameters()}, {id(p) for p in model.parameters()})
        for step in range(2):
            for module, optim in ((wrapped, early), (twin, late)):
                optim.zero_grad()
                module(make_inputs(step, self.rank)).sum().backward()
                optim.step()
        trained = unflattened_params(wrapped)
        for name, (param, _) in unflattened_params(twin).items():
            torch.testing.assert_close(trained[name][0], param, msg=name)
        for name, param in initial.named_parameters():
            self.assertFalse(torch.equal(trained[name][0], param), name)

    def test_a_rank_holding_none_of_a_parameter_gets_no_grad_like_torch(self):
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))  # rank 0: 41 of weight 0
        self.sync_module_states(model)
        ours = FullyShardedDataParallel(copy.deepcopy(model), use_orig_params=True)
        theirs = TorchFSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        grads = []
        for wrapped in (ours, theirs):
            optim = torch.optim.Adam(wrapped.parameters())
            wrapped(torch.ones(2, 8)).sum().backward()
            optim.step()
            grads.append([param.grad is None for param in wrapped.parameters()])
            grads.append(sorted(optim.state_dict()["state"]))
        self.assertEqual(grads[:2], grads[2:])
        self.assertEqual(grads[0], [False, True, True, True] if self.rank == 0 else [False] * 4)

    def test_gradient_kept_under_no_sync_stays_in_param_dtype_like_torch(self):
        """Under ``no_sync()`` with ``MixedPrecision(param_dtype=fp16, reduce_dtype=fp32)``
        torch's wrapper keeps the unsharded gradient in fp16, the dtype the backward made it
        in, so ``.grad`` shows fp16 until a synced backward reduces it in fp32."""
        mixed = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        for strategy in (
            ShardingStrategy.FULL_SHARD,
            ShardingStrategy.SHARD_GRAD_OP,
            ShardingStrategy.NO_SHARD,
        ):
            for use_orig_params in (False, True):
                model = FullyShardedDataParallel(
                    nn.Linear(3, 3),
                    sharding_strategy=strategy,
                    mixed_precision=mixed,
                    use_orig_params=use_orig_params,
                )
                where = f"{strategy.name}, use_orig_params={use_orig_params}"
                inputs = torch.randn(2, 3)
                with model.no_sync():
                    for _ in range(2):
                        model(inputs).sum().backward()
                        grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
                        self.assertEqual(grads, {torch.float16}, where)
                model(inputs).sum().backward()
                grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
                self.assertEqual(grads, {torch.float32}, where)

    def test_repr_matches_torch_before_and_after_a_step(self):
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        for use_orig_params in (False, True):
            ours = FullyShardedDataParallel(MLPBlocks(4), use_orig_params=use_orig_params)
            theirs = TorchFSDP(
                MLPBlocks(4), use_orig_params=use_orig_params, device_id=torch.device("cpu")
            )
            self.assertEqual(repr(ours), repr(theirs))
            ours(torch.randn(2, 4)).sum().backward()
            self.assertEqual(repr(ours), repr(theirs))

    def test_batch_norm_keeps_full_precision_like_torch(self):
        """Under an auto-wrap policy with low-precision buffers, batch norm is wrapped with
        mixed precision off: its running statistics stay fp32 and it computes in fp32."""
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

        from reffsdp.wrap import ModuleWrapPolicy

        low = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        low["buffer_dtype"] = torch.bfloat16
        sides = (
            (FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy, {}),
            (TorchFSDP, TorchMixedPrecision, TorchModuleWrapPolicy, {"device_id": "cpu"}),
        )
        base = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
        self.sync_module_states(base)
        seen = []
        for wrapper_cls, mp_cls, policy_cls, extra in sides:
            model = copy.deepcopy(base)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # both name the batch norm they wrap alone
                wrapped = wrapper_cls(
                    model,
                    mixed_precision=mp_cls(**low),
                    auto_wrap_policy=policy_cls({nn.Linear}),
                    **extra,
                )
            out = wrapped(torch.arange(12.0).view(3, 4) / 10 + self.rank)
            out.sum().backward()
            norm = wrapped.module[1].module
            seen.append((out.dtype, norm.running_mean.dtype, norm.running_var.dtype, out))
        self.assertEqual(seen[0][:3], (torch.bfloat16, torch.float32, torch.float32))
        self.assertEqual(seen[0][:3], seen[1][:3])
        torch.testing.assert_close(seen[0][3], seen[1][3])

    def test_tied_weights(self):
        self.run_subtests(
            {"strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP], "use_orig_params": [False, True]},
            self._check_tied,
        )

    def _check_tied(self, strategy, use_orig_params):
        model = init_deterministic(TiedStack())
        ref_model = copy.deepcopy(model)
        wrapped = wrap_blocks(
            model, {MLP}, sharding_strategy=strategy, use_orig_params=use_orig_params
        )
        root = wrapped._handle
        self.assertEqual(len(root.fqns), len(set(root.fqns)))
        if use_orig_params:  # one shard view, shown under both names
            self.assertIs(model.head.weight, model.proj.weight)
        check_train_parity(self, ref_model, wrapped, make_inputs, num_steps=2)


class TestWrapperOnOneRank(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 1

    def test_sharding_over_one_rank_runs_no_shard_like_torch(self):
        """FULL_SHARD / SHARD_GRAD_OP over one rank run as NO_SHARD, with a warning that
        says so, in every instance; hybrid strategies keep theirs. As torch's wrapper."""
        for strategy in (S.FULL_SHARD, S.SHARD_GRAD_OP):
            seen = []
            for api in ("reffsdp", "torch"):
                # torch's test_world_size_1_sharding_strategy_warning's pattern
                expected = (
                    f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the "
                    "world size is 1."
                )
                with pytest.warns(UserWarning, match=expected):
                    wrapped = blocks_wrapped_by(api, strategy, use_orig_params=True)
                strategies_run = {
                    m.sharding_strategy.name for m in wrapped.modules() if hasattr(m, "_handle")
                }
                seen.append((strategies_run, [tuple(p.shape) for p in wrapped.parameters()]))
            self.assertEqual(seen[0], seen[1], strategy)
            self.assertEqual(seen[0][0], {"NO_SHARD"})
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        hybrid = FullyShardedDataParallel(
            blocks_model(), sharding_strategy=S.HYBRID_SHARD, device_mesh=mesh
        )
        self.assertIs(hybrid.sharding_strategy, S.HYBRID_SHARD)

    def test_unsafe_setattr_environment_variable_like_torch(self):
        """Original parameters are shown through the module's ``__setattr__`` unless
        FSDP_USE_UNSAFE_SETATTR=1 at construction (one rank: the environment is shared)."""
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        calls = []

        class SetattrLinear(nn.Linear):
            def __setattr__(self, name, value):
                calls.append(name)
                super().__setattr__(name, value)

        sides = ((FullyShardedDataParallel, {}), (TorchFSDP, {"device_id": "cpu"}))
        previous = os.environ.pop("FSDP_USE_UNSAFE_SETATTR", None)
        try:
            for setting, expect_calls in ((None, True), ("1", False), ("0", True)):
                if setting is not None:
                    os.environ["FSDP_USE_UNSAFE_SETATTR"] = setting
                for (wrapper_cls, extra), use_orig_params in itertools.product(sides, [0, 1]):
                    model = wrapper_cls(
                        SetattrLinear(4, 4), use_orig_params=bool(use_orig_params), **extra
                    )
                    calls.clear()
                    model(torch.ones(2, 4))
                    where = (setting, wrapper_cls.__name__, use_orig_params)
                    self.assertEqual("weight" in calls, expect_calls, where)
        finally:
            os.environ.pop("FSDP_USE_UNSAFE_SETATTR", None)
            if previous is not None:
                os.environ["FSDP_USE_UNSAFE_SETATTR"] = previous


class TiedStack(nn.Module):
    """``proj`` and ``head`` share one weight around two MLP blocks: one parameter that the
    root instance flattens once and uses twice."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([MLP(DIM, dim_multiplier=3), MLP(DIM)])
        self.head = nn.Linear(DIM, DIM, bias=False)
        self.head.weight = self.proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).tanh()
