"""``FullyShardedDataParallel``'s full-parameter and utility methods on two threaded ranks.

``summon_full_params``, prefix-free names, ``clip_grad_norm_``, ``apply``,
``keep_low_precision_grads`` and forward-input casting, each checked against an unsharded
local reference (gradients: the average of both ranks' losses, as DDP computes) or against
torch's own wrapper on the same group where the behaviour is a naming or casting rule.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp import MixedPrecision, ShardingStrategy
from reffsdp.testing.models import init_deterministic
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread

CPU = torch.device("cpu")
STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]


class Net(nn.Module):
    """A root with its own parameters, one nested instance (``block``) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 5)
        self.block = nn.Sequential(nn.Linear(5, 5), nn.ReLU())
        self.out = nn.Linear(5, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(torch.relu(self.inp(x)))) * self.scale


def _reference() -> Net:
    return init_deterministic(Net())


def _wrap(ref: nn.Module, cls=FSDP, **kwargs) -> nn.Module:
    if cls is TorchFSDP:
        kwargs["device_id"] = CPU
        if "sharding_strategy" in kwargs:
            strategy = kwargs["sharding_strategy"]
            from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

            kwargs["sharding_strategy"] = TorchStrategy[strategy.name]
    model = copy.deepcopy(ref)
    model.block = cls(model.block, **kwargs)
    return cls(model, **kwargs)


def _input(rank: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(rank + 1))


def _loss(model: nn.Module, rank: int) -> torch.Tensor:
    return model(_input(rank)).pow(2).sum()


def _reference_backward(ref: nn.Module, world_size: int) -> None:
    """The data-parallel gradient: the average over ranks of each rank's gradient."""
    sum(_loss(ref, r) for r in range(world_size)).div(world_size).backward()


def _assert_equal(actual: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> None:
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual.detach(), expected.detach(), **tol)


class TestSummonFullParams(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_full_params_under_original_names(self):
        self.run_subtests(
            {"use_orig_params": [False, True], "strategy": STRATEGIES}, self._test_full_params
        )

    def _test_full_params(self, use_orig_params, strategy):
        ref = _reference()
        model = _wrap(ref, use_orig_params=use_orig_params, sharding_strategy=strategy)
        torch_model = _wrap(
            ref, TorchFSDP, use_orig_params=use_orig_params, sharding_strategy=strategy
        )
        names = lambda m: [n for n, _ in m.named_parameters()]  # noqa: E731
        buffer_names = lambda m: [n for n, _ in m.named_buffers()]  # noqa: E731
        self.assertEqual(names(model), names(torch_model))  # outside: the wrapper's prefixes
        self.assertEqual(buffer_names(model), buffer_names(torch_model))
        with FSDP.summon_full_params(model), TorchFSDP.summon_full_params(torch_model):
            self.assertEqual(names(model), names(torch_model))
            self.assertEqual(buffer_names(model), buffer_names(torch_model))
            self.assertEqual(names(model.block), names(torch_model.block))
            params = dict(model.named_parameters())
            self.assertEqual(list(params), [n for n, _ in ref.named_parameters()])
            for name, expected in ref.named_parameters():
                self.assertIsInstance(params[name], nn.Parameter)
                _assert_equal(params[name], expected, exact=True)
        self.assertEqual(names(model), names(torch_model))

    def test_shapes_after_a_forward_match_torch(self):
        """use_orig_params=True: inside a rank0_only summon (other ranks keep their shards)
        and after summons, parameters show as torch's, also when forward left the root's
        buffer gathered."""
        self.run_subtests(
            {"strategy": STRATEGIES, "grad": [False, True]}, self._test_shapes_after_a_forward
        )

    def _test_shapes_after_a_forward(self, strategy, grad):
        ref = _reference()
        seen = []
        for cls in (FSDP, TorchFSDP):
            model = _wrap(ref, cls, use_orig_params=True, sharding_strategy=strategy)
            shapes = []
            with torch.set_grad_enabled(grad):
                model(_input(self.rank))
            for rank0_only in (True, False):
                with cls.summon_full_params(model, rank0_only=rank0_only, writeback=False):
                    shapes.append([tuple(p.shape) for p in model.parameters()])
                shapes.append([tuple(p.shape) for p in model.parameters()])
            seen.append(shapes)
        self.assertEqual(seen[0], seen[1])

    def test_writeback(self):
        self.run_subtests(
            {"use_orig_params": [False, True], "strategy": STRATEGIES}, self._test_writeback
        )

    def _test_writeback(self, use_orig_params, strategy):
        ref = _reference()
        model = _wrap(ref, use_orig_params=use_orig_params, sharding_strategy=strategy)
        with FSDP.summon_full_params(model):
            for param in model.parameters():
                param.data.add_(1.0)
        with torch.no_grad():
            for param in ref.parameters():
                param.add_(1.0)
        with FSDP.summon_full_params(model, writeback=False):
            for (_, actual), (_, expected) in zip(model.named_parameters(), ref.named_parameters()):
                _assert_equal(actual, expected, exact=True)
                actual.data.zero_()  # discarded on exit, except NO_SHARD (as in torch)
        with FSDP.summon_full_params(model):
            for actual, expected in zip(model.parameters(), ref.parameters()):
                if strategy is ShardingStrategy.NO_SHARD:
                    _assert_equal(actual, torch.zeros_like(expected), exact=True)
                else:
                    _assert_equal(actual, expected, exact=True)
        if strategy is not ShardingStrategy.NO_SHARD:  # the edited shards train
            _assert_equal(model(_input(self.rank)), ref(_input(self.rank)))

    def test_rank0_only(self):
        self.run_subtests({"use_orig_params": [False, True]}, self._test_rank0_only)

    def _test_rank0_only(self, use_orig_params):
        ref = _reference()
        model = _wrap(ref, use_orig_params=use_orig_params)
        with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
            shapes = {n: p.shape for n, p in model.named_parameters()}
            expected = {n: p.shape for n, p in ref.named_parameters()}
            self.assertEqual(shapes == expected, self.rank == 0)
        with self.assertRaisesRegex(NotImplementedError, "rank0_only"):
            with FSDP.summon_full_params(model, rank0_only=True, writeback=True):
                pass

    def test_offload_to_cpu(self):
        self.run_subtests({"use_orig_params": [False, True]}, self._test_offload_to_cpu)

    def _test_offload_to_cpu(self, use_orig_params):
        ref = _reference()
        model = _wrap(ref, use_orig_params=use_orig_params)
        with FSDP.summon_full_params(model, offload_to_cpu=True, rank0_only=True, writeback=False):
            if self.rank == 0:
                for actual, expected in zip(model.parameters(), ref.parameters()):
                    self.assertEqual(actual.device.type, "cpu")
                    _assert_equal(actual, expected, exact=True)
        with FSDP.summon_full_params(model, offload_to_cpu=True):
            model.module.inp.weight.data.fill_(3.0)
        with FSDP.summon_full_params(model):
            _assert_equal(model.module.inp.weight, torch.full((5, 3), 3.0), exact=True)
        no_shard = _wrap(ref, sharding_strategy=ShardingStrategy.NO_SHARD)
        with self.assertRaisesRegex(NotImplementedError, "NO_SHARD"):
            with FSDP.summon_full_params(no_shard, offload_to_cpu=True):
                pass

    def test_recurse_false_and_nesting(self):
        self.run_subtests({"use_orig_params": [False, True]}, self._test_recurse_false)

    def _test_recurse_false(self, use_orig_params):
        ref = _reference()
        model = _wrap(ref, use_orig_params=use_orig_params)
        block_weight = lambda: model.module.block.module[0].weight  # noqa: E731
        with FSDP.summon_full_params(model, recurse=False):
            self.assertEqual(model.module.inp.weight.shape, (5, 3))
            if use_orig_params:
                self.assertEqual(block_weight().dim(), 1)  # still this rank's shard
            else:  # as torch's: a full-shaped plain tensor with no storage
                self.assertNotIsInstance(block_weight(), torch.nn.Parameter)
                self.assertEqual(block_weight().shape, (5, 5))
                self.assertEqual(block_weight().untyped_storage().size(), 0)
        with FSDP.summon_full_params(model.module.block):
            self.assertEqual(block_weight().shape, (5, 5))
            with FSDP.summon_full_params(model, recurse=False):  # allowed, as in torch
                self.assertEqual(model.module.inp.weight.shape, (5, 3))
            with self.assertRaisesRegex(AssertionError, "already"):
                with FSDP.summon_full_params(model):  # the block would be summoned twice
                    pass

    def test_with_grads(self):
        self.run_subtests(
            {"strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD]},
            self._test_with_grads,
        )

    def _test_with_grads(self, strategy):
        ref = _reference()
        model = _wrap(ref, use_orig_params=True, sharding_strategy=strategy)
        _loss(model, self.rank).backward()
        _reference_backward(ref, self.world_size)
        with FSDP.summon_full_params(model, with_grads=True):
            for actual, expected in zip(model.parameters(), ref.parameters()):
                self.assertEqual(actual.grad.shape, expected.shape)
                _assert_equal(actual.grad, expected.grad)
                actual.grad.mul_(2.0)
        with FSDP.summon_full_params(model, with_grads=True):
            for actual, expected in zip(model.parameters(), ref.parameters()):
                _assert_equal(actual.grad, 2.0 * expected.grad)
        for param in model.parameters():  # a rank holding none of it: no gradient, as before
            self.assertEqual(param.grad is None, param.numel() == 0)
        plain = _wrap(ref, use_orig_params=False)
        with self.assertRaisesRegex(NotImplementedError, "use_orig_params"):
            with FSDP.summon_full_params(plain, with_grads=True):
                pass

    def test_inside_forward_or_backward_raises(self):
        ref = _reference()
        model = _wrap(ref)
        errors = []

        def summon(*_):
            try:
                with FSDP.summon_full_params(model):
                    pass
            except AssertionError as exc:
                errors.append(str(exc))

        handle = model.module.inp.register_forward_pre_hook(summon)
        out = model(_input(self.rank))
        handle.remove()
        out.register_hook(summon)
        out.pow(2).sum().backward()
        self.assertEqual(len(errors), 2)
        self.assertIn("in training state FORWARD", errors[0])
        self.assertIn("in training state PRE_BACKWARD", errors[1])
        with FSDP.summon_full_params(model):  # fine again after backward
            pass

    def test_mixed_precision_summons_full_precision(self):
        self.run_subtests(
            {"use_orig_params": [False, True], "strategy": STRATEGIES[:2]},
            self._test_mixed_precision,
        )

    def _test_mixed_precision(self, use_orig_params, strategy):
        ref = _reference()
        mp = MixedPrecision(param_dtype=torch.bfloat16)
        kwargs = dict(use_orig_params=use_orig_params, sharding_strategy=strategy)
        model = _wrap(ref, mixed_precision=mp, **kwargs)
        with FSDP.summon_full_params(model):
            for actual, expected in zip(model.parameters(), ref.parameters()):
                self.assertEqual(actual.dtype, torch.float32)
                _assert_equal(actual, expected, exact=True)
        # Between forward and backward (SHARD_GRAD_OP keeps parameters unsharded).
        twin = _wrap(ref, mixed_precision=mp, **kwargs)
        loss, twin_loss = _loss(model, self.rank), _loss(twin, self.rank)
        with FSDP.summon_full_params(model):
            for actual, expected in zip(model.parameters(), ref.parameters()):
                _assert_equal(actual, expected, exact=True)
        loss.backward()
        twin_loss.backward()
        for actual, expected in zip(model.parameters(), twin.parameters()):
            if actual.numel() == 0:  # none of it on this rank (use_orig_params): no gradient
                self.assertIsNone(actual.grad)
                self.assertIsNone(expected.grad)
            else:
                _assert_equal(actual.grad, expected.grad, exact=True)


class TestWrapperUtilities(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_clip_grad_norm_matches_unsharded(self):
        self.run_subtests(
            {
                "use_orig_params": [False, True],
                "strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD],
                "norm_type": [2.0, 1.0, math.inf],
            },
            self._test_clip,
        )

    def _test_clip(self, use_orig_params, strategy, norm_type):
        ref = _reference()
        model = _wrap(ref, use_orig_params=use_orig_params, sharding_strategy=strategy)
        _loss(model, self.rank).backward()
        _reference_backward(ref, self.world_size)
        total = model.clip_grad_norm_(0.5, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
        self.assertGreater(float(expected), 0.5)  # clipping happens
        _assert_equal(total, expected)
        for opt in (
            torch.optim.SGD(model.parameters(), lr=1.0),
            torch.optim.SGD(ref.parameters(), lr=1.0),
        ):
            opt.step()
        with FSDP.summon_full_params(model):
            for actual, expected_param in zip(model.parameters(), ref.parameters()):
                _assert_equal(actual, expected_param)

    def test_clip_grad_norm_with_ignored_params(self):
        ref = _reference()
        model = copy.deepcopy(ref)
        model.block = FSDP(model.block)
        model = FSDP(model, ignored_modules=[model.out])
        _loss(model, self.rank).backward()
        _reference_backward(ref, self.world_size)
        local = [p.grad for p in model.module.out.parameters()]  # never reduced
        managed = [p.grad for n, p in ref.named_parameters() if not n.startswith("out.")]
        expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in managed + local]))
        _assert_equal(model.clip_grad_norm_(0.5), expected)

    def test_clip_grad_norm_dtype_and_root_only(self):
        ref = _reference()
        for keep, dtype in ((False, torch.float32), (True, torch.bfloat16)):
            mp = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=keep)
            model = _wrap(ref, mixed_precision=mp)
            _loss(model, self.rank).backward()
            self.assertEqual(model.clip_grad_norm_(1.0).dtype, dtype)
        for cls in (FSDP, TorchFSDP):
            model = _wrap(ref, cls)
            model(_input(self.rank)).sum().backward()
            with self.assertRaisesRegex(
                RuntimeError, "should only be called on the root FSDP instance"
            ):
                model.module.block.clip_grad_norm_(1.0)

    def test_clip_grad_norm_without_gradients_warns_like_torch(self):
        """Rank 0 alone catches warnings: ranks in threads share the warning filters. It
        enters the check before clip_grad_norm_'s all-reduce, which rank 1 waits for."""
        regex = (
            rf"on rank {self.rank} with no gradients -- returning the total norm in the "
            "default dtype torch.float32"
        )
        for cls in (FSDP, TorchFSDP):
            model = _wrap(_reference(), cls, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
            model(_input(self.rank))
            checking = contextlib.nullcontext()
            if self.rank == 0:
                checking = pytest.warns(UserWarning, match=regex)
            with checking:
                total = model.clip_grad_norm_(1.0)
            self.assertEqual((total.dtype, total.item()), (torch.float32, 0.0))

    def test_keep_low_precision_grads(self):
        self.run_subtests({"use_orig_params": [False, True]}, self._test_keep_low_precision_grads)

    def _test_keep_low_precision_grads(self, use_orig_params):
        ref = _reference()
        grads = {}
        for keep in (False, True):
            mp = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=keep)
            model = _wrap(ref, mixed_precision=mp, use_orig_params=use_orig_params)
            _loss(model, self.rank).backward()
            grads[keep] = [p.grad for p in model.parameters() if p.grad is not None]
        for kept, full in zip(grads[True], grads[False]):
            self.assertEqual((kept.dtype, full.dtype), (torch.bfloat16, torch.float32))
            _assert_equal(kept, full.to(torch.bfloat16), exact=True)

    def test_apply_shows_full_params_and_writes_back(self):
        self.run_subtests({"use_orig_params": [False, True]}, self._test_apply)

    def _test_apply(self, use_orig_params):
        ref = _reference()
        model = _wrap(ref, use_orig_params=use_orig_params)
        shapes = []

        def fill(module):
            shapes.extend(tuple(p.shape) for p in module.parameters(recurse=False))
            if isinstance(module, nn.Linear):
                module.weight.data.fill_(0.25)

        model.apply(fill)
        ref.apply(fill)
        self.assertEqual(shapes[: len(shapes) // 2], shapes[len(shapes) // 2 :])
        self.assertIsNone(model._is_root)  # apply's lazy init is undone
        _assert_equal(model(_input(self.rank)), ref(_input(self.rank)))
        self.assertTrue(model._is_root)

    def test_apply_inside_summon_full_params_is_a_value_error_like_torch(self):
        for cls in (FSDP, TorchFSDP):
            model = _wrap(_reference(), cls)
            with cls.summon_full_params(model):
                with pytest.raises(ValueError, match="expected to be in states"):
                    model.apply(lambda module: None)
            model.apply(lambda module: None)  # outside: fine

    def test_forward_input_casting_matches_torch(self):
        self.run_subtests(
            {"cast_forward_inputs": [False, True], "cast_root_forward_inputs": [False, True]},
            self._test_input_casting,
        )

    def _test_input_casting(self, cast_forward_inputs, cast_root_forward_inputs):
        ref = _reference()
        seen = {}
        for cls, mp_cls in ((FSDP, MixedPrecision), (TorchFSDP, TorchMixedPrecision)):
            mp = mp_cls(
                param_dtype=torch.bfloat16,
                cast_forward_inputs=cast_forward_inputs,
                cast_root_forward_inputs=cast_root_forward_inputs,
            )
            model = _wrap(ref, cls, mixed_precision=mp)
            dtypes = []
            inner = model.module.block.module
            record = lambda _, args, seen=dtypes: seen.append(args[0].dtype)  # noqa: E731
            for module in (model.module.inp, inner[0]):
                module.register_forward_pre_hook(record)
            x = _input(self.rank)
            try:
                model(x)
            except RuntimeError:  # a float32 input reached a bfloat16 Linear
                dtypes.append("error")
            dtypes.append("|")
            try:  # the nested instance alone, after the root's lazy init
                model.module.block(torch.ones(2, 5))
            except RuntimeError:
                dtypes.append("error")
            seen[cls] = dtypes
        self.assertEqual(seen[FSDP], seen[TorchFSDP])
