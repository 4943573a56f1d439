"""``fully_shard`` gradient accumulation and reduction knobs, against DDP.

Accumulation with and without gradient sync, and the ``FSDPModule`` knobs that act on
backward and on the gradient reduction. Where a knob is meant to change the gradients (a
divide factor, an all-reduce hook) the test asserts the exact change relative to DDP.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from reffsdp import FSDPModule, fully_shard
from reffsdp.core import comms
from reffsdp.core.comms import ReduceOp
from reffsdp.core.sharding import chunk_rows
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, DoubleLinear, MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity
from reffsdp.testing.patching import count_all_gathers, patch_reduce_scatter

pytestmark = pytest.mark.multithread


def _vectors(dim: int, batch: int = 2):
    return random_inputs(batch, dim)


def _shard_stack(model: nn.Module, **kwargs) -> None:
    """``fully_shard`` every child, then the model (bottom-up)."""
    for child in model.children():
        fully_shard(child, **kwargs)
    fully_shard(model, **kwargs)


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _expected_shard(ref: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of the unsharded ``ref``, cut the way ``param`` is sharded."""
    return distribute_tensor(
        ref.detach(), param.device_mesh, param.placements, src_data_rank=None
    ).to_local()


class TestFullyShardGradients(FSDPTestMultiThread):
    """Gradient accumulation and the knobs that act on backward and on reductions."""

    @property
    def world_size(self) -> int:
        return 2

    def _stack(self) -> tuple[nn.Module, nn.Module]:
        model = MLPStack(8)
        self.sync_module_states(model)
        ref_model = copy.deepcopy(model)
        _shard_stack(model)
        return ref_model, model

    def test_accumulate_with_gradient_sync(self):
        ref_model, model = self._stack()
        check_train_parity(self, ref_model, model, _vectors(8), num_steps=2, num_microbatches=3)

    def test_accumulate_without_gradient_sync(self):
        self.run_subtests(
            {"reshard_after_backward": [True, False]}, self._test_accumulate_without_sync
        )

    def _test_accumulate_without_sync(self, reshard_after_backward: bool):
        ref_model, model = self._stack()

        @contextlib.contextmanager
        def no_sync(module: FSDPModule):
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(reshard_after_backward)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
                module.set_reshard_after_backward(True)

        num_steps, num_microbatches = 2, 3
        with count_all_gathers() as count:
            check_train_parity(
                self,
                ref_model,
                model,
                _vectors(8),
                num_steps=num_steps,
                num_microbatches=num_microbatches,
                no_sync=no_sync,
            )
        # Three blocks, each gathered in forward and again in backward (the root has no
        # parameters). Without resharding after backward, a microbatch that follows one
        # inside no_sync finds its parameters still unsharded and skips the forward gathers.
        skipped_forwards = 0 if reshard_after_backward else num_microbatches - 1
        expected = num_steps * 3 * (2 * num_microbatches - skipped_forwards)
        self.assertEqual(count[0], expected)

    def test_is_last_backward(self):
        ref_model, model = self._stack()

        @contextlib.contextmanager
        def not_last(module: FSDPModule):
            module.set_is_last_backward(False)
            try:
                yield
            finally:
                module.set_is_last_backward(True)

        check_train_parity(
            self,
            ref_model,
            model,
            _vectors(8),
            num_steps=2,
            num_microbatches=3,
            no_sync=not_last,
        )

    def test_unshard_in_backward(self):
        self.run_subtests({"unshard_in_backward": [True, False]}, self._test_unshard_in_backward)

    def _test_unshard_in_backward(self, unshard_in_backward: bool):
        # An embedding's backward needs the token ids, not its weight, so the embedding need
        # not be gathered again in backward.
        model = nn.Sequential(nn.Embedding(16, 8), MLP(8), MLP(8))
        self.sync_module_states(model)
        ref_model = copy.deepcopy(model)
        _shard_stack(model)
        model[0].set_unshard_in_backward(unshard_in_backward)

        def make_tokens(iteration: int, rank: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(1000 * iteration + rank)
            return torch.randint(0, 16, (2, 4), generator=generator)

        num_steps = 2
        with count_all_gathers() as count:
            check_train_parity(self, ref_model, model, make_tokens, num_steps=num_steps)
        per_step = 3 + (3 if unshard_in_backward else 2)  # forward + backward
        self.assertEqual(count[0], num_steps * per_step)

    def test_reduce_scatter_unused_params_used_on_some_ranks(self):
        # lin2 runs on rank 0 only: every rank must still join its reduction, with zeros,
        # which is what DDP's find_unused_parameters computes.
        model = DoubleLinear(8)
        self.sync_module_states(model)
        ref_model = copy.deepcopy(model)
        fully_shard(model)
        model.set_reduce_scatter_unused_params(True)
        for m in (ref_model, model):
            m.use_second_linear = self.rank == 0
        check_train_parity(
            self,
            ref_model,
            model,
            _vectors(8),
            num_steps=3,
            ddp_kwargs={"find_unused_parameters": True},
        )

    def test_reduce_scatter_unused_params_unused_everywhere(self):
        # DDP leaves a parameter unused on every rank without a gradient; FSDP reduces zeros
        # for it (as torch's FSDP2 does), and the optimizer step leaves it unchanged alike.
        model = DoubleLinear(8, use_second_linear=False)
        self.sync_module_states(model)
        ref_model = copy.deepcopy(model)
        fully_shard(model)
        model.set_reduce_scatter_unused_params(True)
        ddp_model = DistributedDataParallel(ref_model, find_unused_parameters=True)
        inputs = _vectors(8)(0, self.rank)
        ddp_model(inputs).sum().backward()
        model(inputs).sum().backward()
        for name, param in model.named_parameters():
            ref_param = ref_model.get_parameter(name)
            self.assertIsInstance(param.grad, DTensor, name)
            if name.startswith("lin2."):
                self.assertIsNone(ref_param.grad, name)
                self.assertEqual(param.grad.placements, param.placements, name)
                torch.testing.assert_close(
                    param.grad.to_local(), torch.zeros_like(param.to_local())
                )
            else:
                torch.testing.assert_close(
                    param.grad.to_local(), _expected_shard(ref_param.grad, param)
                )

    def test_gradient_divide_factor(self):
        factors = [1.0, float(self.world_size), 2.0 * self.world_size, 3.0]
        self.run_subtests({"factor": factors}, self._test_gradient_divide_factor)

    def _test_gradient_divide_factor(self, factor: float):
        ref_model, model = self._stack()
        for module in _fsdp_modules(model):
            module.set_gradient_divide_factor(factor)
        # Sharded gradients are sums over ranks divided by `factor`; DDP's are averages.
        self._check_grads_scaled(ref_model, model, self.world_size / factor)

    def _check_grads_scaled(self, ref_model: nn.Module, model: nn.Module, scale: float):
        ddp_model = DistributedDataParallel(ref_model)
        for iteration in range(2):  # the second backward accumulates into the first's grads
            inputs = _vectors(8)(iteration, self.rank)
            ddp_model(inputs).sum().backward()
            model(inputs).sum().backward()
            for name, param in model.named_parameters():
                expected = _expected_shard(ref_model.get_parameter(name).grad * scale, param)
                torch.testing.assert_close(param.grad.to_local(), expected, msg=name)

    def test_force_sum_reduction_for_comms(self):
        ref_model, model = self._stack()
        for module in _fsdp_modules(model):
            module.set_force_sum_reduction_for_comms(True)
        ops = []

        def recording(output, input, op=ReduceOp.SUM, group=None, async_op=False):
            ops.append(op)
            return comms.torch_reduce_scatter()(
                output, input, op=op, group=group, async_op=async_op
            )

        with patch_reduce_scatter(recording):
            check_train_parity(self, ref_model, model, _vectors(8), num_steps=2)
        self.assertEqual(ops, [ReduceOp.SUM] * 2 * 3)  # two steps, three groups

    def test_all_reduce_hook(self):
        ref_model, model = self._stack()
        seen = []

        def double(reduced: torch.Tensor) -> None:
            seen.append(reduced.numel())
            reduced.mul_(2)

        for module in _fsdp_modules(model):
            module.set_all_reduce_hook(double)
        self._check_grads_scaled(ref_model, model, 2.0)
        # One call per group and backward, on this rank's reduced shard: every parameter's
        # rows padded to ceil(rows / world_size).
        shard_numels = [
            sum(chunk_rows(p.size(0), self.world_size) * p[0].numel() for p in block.parameters())
            for block in reversed(list(model))
        ]
        self.assertEqual(seen, shard_numels * 2)


class TestFullyShardGradientsWorldSize4(TestFullyShardGradients):
    @property
    def world_size(self) -> int:
        return 4
