"""``FullyShardedDataParallel.register_comm_hook``: a hook replaces every instance's reduction.

The reference for gradients is DDP's: each rank's local gradient, summed over ranks and
divided by the world size, then cut like the flat parameter (see ``_expected_shard``).
torch's own ``FullyShardedDataParallel`` (with ``device_id=cpu``) is the reference for how
often a hook is called, what it is handed and which errors registration raises.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._comm_hooks import default_hooks as torch_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

from reffsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from reffsdp.algorithms import LOW_PRECISION_HOOKS, default_hooks
from reffsdp.core import comms
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = [
    pytest.mark.multithread,
    pytest.mark.filterwarnings("ignore:.*NO_SHARD.*:FutureWarning"),
]

FULL_SHARD = ShardingStrategy.FULL_SHARD
SHARD_GRAD_OP = ShardingStrategy.SHARD_GRAD_OP
NO_SHARD = ShardingStrategy.NO_SHARD
_make_inputs = random_inputs(2, 8)
_TORCH_CPU = {"device_id": torch.device("cpu")}  # torch's wrapper needs it on a CPU machine


def _model() -> nn.Sequential:
    # The root keeps 16 * 3 + 3 = 51 elements: odd, so two ranks' shards need padding.
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _wrap(model: nn.Sequential, wrapper_cls=FullyShardedDataParallel, **kwargs) -> nn.Module:
    model[0] = wrapper_cls(model[0], **kwargs)
    return wrapper_cls(model, **kwargs)


class _Recorder:
    """Wraps a hook; records ``(grad numel, output numel or None, grad dtype)`` per call."""

    def __init__(self, hook: Callable[..., None]) -> None:
        self.hook = hook
        self.calls: list[tuple[int, int | None, torch.dtype]] = []

    def __call__(self, state, grad, output=None):
        self.calls.append((grad.numel(), None if output is None else output.numel(), grad.dtype))
        if output is None:
            return self.hook(state, grad)
        return self.hook(state, grad, output)


def _sum_then_divide(state: default_hooks.DefaultState, grad, output=None) -> None:
    """The plain data-parallel average, written out: sum over ranks, divide by their count."""
    if output is None:
        comms.all_reduce(grad, state.process_group)
        grad.div_(state.world_size)
    else:
        comms.reduce_scatter(output, grad, state.process_group)
        output.div_(state.world_size)


def _default_hook(state, grad, output=None) -> None:
    if output is None:
        default_hooks.allreduce_hook(state, grad)
    else:
        default_hooks.reduce_scatter_hook(state, grad, output)


def _ddp_grads(ref: nn.Module, inputs: torch.Tensor) -> None:
    """DDP's gradients on ``ref``: local gradients averaged over the ranks."""
    ref(inputs).sum().backward()
    for param in ref.parameters():
        dist.all_reduce(param.grad)
        param.grad.div_(dist.get_world_size())


def _instances_and_refs(model: nn.Module, ref: nn.Sequential):
    """Each wrapper instance with the reference module holding its parameters."""
    return [(model, ref), (model[0], ref[0])]


def _expected_shard(instance: FullyShardedDataParallel, grads: dict[str, torch.Tensor]):
    """``grads`` laid out like the instance's flat parameter, and this rank's padded chunk."""
    handle = instance._handle
    layout = handle.layout
    full = torch.zeros(layout.padded_numel)
    for index, fqn in enumerate(handle.fqns):
        grad = grads[fqn].reshape(-1)
        full.narrow(0, layout.param_offsets[index], layout.numels[index]).copy_(grad)
    return full.chunk(instance.world_size)[instance.rank]


def _check_grads(test, model, ref, *, exact: bool = False) -> None:
    tolerance = dict(rtol=0, atol=0) if exact else {}
    for instance, ref_module in _instances_and_refs(model, ref):
        grads = {name: param.grad for name, param in ref_module.named_parameters()}
        expected = _expected_shard(instance, grads)
        handle = instance._handle
        if not handle.use_orig_params:
            test.assertEqual(handle.flat_param.grad.dtype, torch.float32)
            torch.testing.assert_close(handle.flat_param.grad, expected, **tolerance)
            continue
        for index, param in enumerate(handle.orig_params):
            piece = handle.orig_piece(expected, index)
            if piece.numel() == 0:  # none of the parameter on this rank: no gradient
                test.assertIsNone(param.grad)
            else:
                torch.testing.assert_close(param.grad, piece, **tolerance)


class TestWrapperCommHooks(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _models(self):
        model = _model()
        self.sync_module_states(model)
        return copy.deepcopy(model), model

    def test_averaging_hooks_give_ddp_gradients(self):
        self.run_subtests(
            {
                "strategy": [FULL_SHARD, SHARD_GRAD_OP, NO_SHARD],
                "use_orig_params": [False, True],
                "hook": [_sum_then_divide, _default_hook],
            },
            self._test_averaging_hook,
        )

    def _test_averaging_hook(self, strategy, use_orig_params, hook):
        ref, model = self._models()
        model = _wrap(model, sharding_strategy=strategy, use_orig_params=use_orig_params)
        recorder = _Recorder(hook)
        model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), recorder)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
        for iteration in range(2):
            inputs = _make_inputs(iteration, self.rank)
            model(inputs).sum().backward()
            _ddp_grads(ref, inputs)
            _check_grads(self, model, ref)
            for opt in (optim, ref_optim):
                opt.step()
                opt.zero_grad()
        # Once per instance per backward, child first (sizes: test_hook_calls_match_torch).
        sharded = strategy is not NO_SHARD
        expected = []
        for instance in (model[0], model):
            layout = instance._handle.layout
            shard = layout.shard_numel if sharded else None
            expected.append((layout.padded_numel, shard, torch.float32))
        self.assertEqual(recorder.calls, expected * 2)

    def test_hook_calls_match_torch(self):
        """Same calls, same arguments (sizes, dtypes), in the same order as torch's wrapper."""
        self.run_subtests(
            {
                "strategy": ["FULL_SHARD", "NO_SHARD"],
                "use_orig_params": [False, True],
                "param_dtype": [None, torch.bfloat16],
            },
            self._test_hook_calls_match_torch,
        )

    def _test_hook_calls_match_torch(self, strategy, use_orig_params, param_dtype):
        calls = []
        for wrapper_cls, hooks, strategies, mp_cls, extra in (
            (FullyShardedDataParallel, default_hooks, ShardingStrategy, MixedPrecision, {}),
            (TorchFSDP, torch_hooks, TorchShardingStrategy, TorchMixedPrecision, _TORCH_CPU),
        ):
            model = _wrap(
                _model(),
                wrapper_cls,
                sharding_strategy=strategies[strategy],
                use_orig_params=use_orig_params,
                mixed_precision=mp_cls(param_dtype=param_dtype),
                **extra,
            )
            no_shard = strategy == "NO_SHARD"
            recorder = _Recorder(hooks.allreduce_hook if no_shard else hooks.reduce_scatter_hook)
            model.register_comm_hook(hooks.DefaultState(dist.group.WORLD), recorder)
            for iteration in range(2):
                model(_make_inputs(iteration, self.rank)).sum().backward()
            grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
            self.assertEqual(grad_dtypes, {torch.float32})
            calls.append(recorder.calls)
        self.assertEqual(calls[0], calls[1])
        self.assertEqual(len(calls[0]), 4)

    def test_low_precision_hooks_match_a_manual_low_precision_reduce(self):
        self.run_subtests(
            {
                "hook": LOW_PRECISION_HOOKS,
                "strategy": [FULL_SHARD, NO_SHARD],
                # A reduce dtype the hook must ignore: it communicates in its own dtype.
                "mixed_precision": [None, MixedPrecision(reduce_dtype=torch.bfloat16)],
            },
            self._test_low_precision_hook,
        )

    def _test_low_precision_hook(self, hook, strategy, mixed_precision):
        ref, model = self._models()
        model = _wrap(model, sharding_strategy=strategy, mixed_precision=mixed_precision)
        # Registered as itself: the wrapper knows the low-precision hooks by identity.
        model.register_comm_hook(default_hooks.LowPrecisionState(dist.group.WORLD), hook)
        inputs = _make_inputs(0, self.rank)
        model(inputs).sum().backward()
        ref(inputs).sum().backward()
        dtype = torch.float16 if hook is default_hooks.fp16_compress_hook else torch.bfloat16
        for param in ref.parameters():  # cast, divide by pre = 2, sum, cast back
            low = param.grad.to(dtype).div_(2)
            dist.all_reduce(low)
            param.grad = low.to(torch.float32)
        # Exact: a gradient cast to the reduce dtype (bf16) before fp16 would round twice.
        _check_grads(self, model, ref, exact=True)

    def test_no_sync_defers_the_hook(self):
        self.run_subtests({"strategy": [FULL_SHARD, SHARD_GRAD_OP]}, self._test_no_sync)

    def _test_no_sync(self, strategy):
        ref, model = self._models()
        model = _wrap(model, sharding_strategy=strategy)
        recorder = _Recorder(_sum_then_divide)
        model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), recorder)
        with model.no_sync():
            model(_make_inputs(0, self.rank)).sum().backward()
        self.assertEqual(recorder.calls, [])
        model(_make_inputs(1, self.rank)).sum().backward()
        self.assertEqual(len(recorder.calls), 2)
        ref(_make_inputs(0, self.rank)).sum().backward()
        _ddp_grads(ref, _make_inputs(1, self.rank))  # averages both microbatches' sum
        _check_grads(self, model, ref)

    def test_registering_after_training_takes_effect(self):
        """torch's wrapper accepts a hook after training started (it warns only in its
        docs); the next backward uses it."""
        model = _wrap(_model())
        model(_make_inputs(0, self.rank)).sum().backward()
        recorder = _Recorder(_sum_then_divide)
        model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), recorder)
        model(_make_inputs(1, self.rank)).sum().backward()
        self.assertEqual(len(recorder.calls), 2)

    def test_registration_errors_match_torch(self):
        state = default_hooks.DefaultState(dist.group.WORLD)
        torch_state = torch_hooks.DefaultState(dist.group.WORLD)
        # torch's own tests match these messages (the first two whole); torch raises
        # "not callable" too, in other words.
        cases = {
            "twice": (AssertionError, "^A communication hook is already registered$"),
            "non-root": (
                AssertionError,
                "^register_comm_hook can only be called on a root instance.$",
            ),
            "not callable": (ValueError, "must be callable, got int"),
            "hybrid": (AssertionError, "Communication hook is not supported for hybrid"),
        }
        for case, (error, message) in cases.items():
            for wrapper_cls, hooks, hook_state in (
                (FullyShardedDataParallel, default_hooks, state),
                (TorchFSDP, torch_hooks, torch_state),
            ):
                is_torch = wrapper_cls is TorchFSDP
                register = self._registration(case, wrapper_cls, hooks, hook_state, is_torch)
                with self.subTest(case=case, torch=is_torch):
                    with pytest.raises(error) as raised:
                        register()
                    if not is_torch or case != "not callable":
                        self.assertRegex(str(raised.value), message)

    def _registration(self, case, wrapper_cls, hooks, state, is_torch):
        kwargs = _TORCH_CPU if is_torch else {}
        strategies = TorchShardingStrategy if is_torch else ShardingStrategy
        hook = hooks.reduce_scatter_hook
        if case == "hybrid":
            mesh = init_device_mesh("cpu", (1, self.world_size))
            model = wrapper_cls(
                nn.Linear(4, 4),
                device_mesh=mesh,
                sharding_strategy=strategies.HYBRID_SHARD,
                **kwargs,
            )
            return lambda: model.register_comm_hook(state, hook)
        model = _wrap(_model(), wrapper_cls, **kwargs)
        if case == "twice":
            model.register_comm_hook(state, hook)
            return lambda: model.register_comm_hook(state, hook)
        if case == "non-root":
            model.check_is_root()  # the root claims its instances first
            return lambda: model[0].register_comm_hook(state, hook)
        return lambda: model.register_comm_hook(state, 3)


def test_default_state_needs_a_process_group():
    with pytest.raises(ValueError, match="explicit process_group"):
        default_hooks.DefaultState(None)


def test_default_hooks_mirror_torch():
    """Every name torch's module offers users, with the same parameters."""
    for name in default_hooks.__all__:
        ours, theirs = getattr(default_hooks, name), getattr(torch_hooks, name)
        assert inspect.signature(ours).parameters.keys() == (
            inspect.signature(theirs).parameters.keys()
        ), name
