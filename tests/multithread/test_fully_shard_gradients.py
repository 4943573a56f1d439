"""``fully_shard`` gradient accumulation and reduction knobs, against DDP.

Accumulation with and without gradient sync, and the ``FSDPModule`` knobs that act on
backward and on the gradient reduction. Where a knob is meant to change the gradients (a
divide factor, an all-reduce hook) the test asserts the exact change relative to DDP.
"""

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from reffsdp import FSDPModule, fully_shard
from reffsdp.core import comms
from reffsdp.core.comms import ReduceOp
from reffsdp.core.sharding import chunk_rows
from reffsdp.testing.build import fsdp_modules, reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs, random_tokens
from reffsdp.testing.models import MLP, DoubleLinear, MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_state_dict_parity, check_train_parity, gradient_sync_off
from reffsdp.testing.patching import count_all_gathers, observe_reduce_scatters

pytestmark = pytest.mark.multithread


make_inputs = random_inputs(2, 8)


def _expected_shard(ref: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of the unsharded ``ref``, cut the way ``param`` is sharded."""
    return distribute_tensor(
        ref.detach(), param.device_mesh, param.placements, src_data_rank=None
    ).to_local()


class GradientChecks:
    """Test bodies that the gloo suite runs too (``tests/multiprocess/test_fully_shard_gloo.py``,
    several in one test, since each of its tests pays for starting the rank processes)."""

    def _stack(self) -> tuple[nn.Module, nn.Module]:
        ref_model, model = reference_and_model(MLPStack(8))
        return ref_model, shard_bottom_up(model, model)

    def check_accumulate_with_gradient_sync(self):
        ref_model, model = self._stack()
        check_train_parity(self, ref_model, model, make_inputs, num_steps=2, num_microbatches=3)
        check_state_dict_parity(self, ref_model, model)

    def check_accumulate_without_sync(self, reshard_after_backward: bool):
        ref_model, model = self._stack()
        no_sync = functools.partial(
            gradient_sync_off, reshard_after_backward=reshard_after_backward
        )
        num_steps, num_microbatches = 2, 3
        with count_all_gathers() as count:
            check_train_parity(
                self,
                ref_model,
                model,
                make_inputs,
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
        check_state_dict_parity(self, ref_model, model)

    def check_reduce_scatter_unused_params_used_on_some_ranks(self):
        # lin2 runs on rank 0 only: every rank must still join its reduction, with zeros,
        # which is what DDP's find_unused_parameters computes.
        ref_model, model = reference_and_model(DoubleLinear(8))
        fully_shard(model)
        model.set_reduce_scatter_unused_params(True)
        for m in (ref_model, model):
            m.use_second_linear = self.rank == 0
        check_train_parity(
            self,
            ref_model,
            model,
            make_inputs,
            num_steps=3,
            ddp_kwargs={"find_unused_parameters": True},
        )

    def check_gradient_divide_factor(self, factor: float):
        ref_model, model = self._stack()
        for module in fsdp_modules(model):
            module.set_gradient_divide_factor(factor)
        # Sharded gradients are sums over ranks divided by `factor`; DDP's are averages.
        ops = self._check_grads_scaled(ref_model, model, self.world_size / factor)
        # Dividing by the world size is an average. Any other factor goes into the
        # collective as PREMUL_SUM where the backend has it (not gloo, nor the threaded group
        # before torch 2.13); elsewhere it sums, then divides.
        if factor == self.world_size:
            expected_op = ReduceOp.AVG
        elif comms.supports_reduce_op(dist.group.WORLD, ReduceOp.PREMUL_SUM):
            expected_op = ReduceOp.PREMUL_SUM
        else:
            expected_op = ReduceOp.SUM
        self.assertEqual(ops, [expected_op] * 2 * 3)  # two backwards, three groups

    def check_force_sum_reduction_for_comms(self):
        ref_model, model = self._stack()
        for module in fsdp_modules(model):
            module.set_force_sum_reduction_for_comms(True)
        ops = []
        with observe_reduce_scatters(lambda output, input, op, group: ops.append(op)):
            check_train_parity(self, ref_model, model, make_inputs, num_steps=2)
        self.assertEqual(ops, [ReduceOp.SUM] * 2 * 3)  # two steps, three groups

    def check_all_reduce_hook(self):
        ref_model, model = self._stack()
        seen = []

        def double(reduced: torch.Tensor) -> None:
            seen.append(reduced.numel())
            reduced.mul_(2)

        for module in fsdp_modules(model):
            module.set_all_reduce_hook(double)
        ops = self._check_grads_scaled(ref_model, model, 2.0)
        self.assertEqual(ops, [ReduceOp.AVG] * 2 * 3)  # two backwards, three groups
        # One call per group and backward, on this rank's reduced shard: every parameter's
        # rows padded to ceil(rows / world_size).
        shard_numels = [
            sum(chunk_rows(p.size(0), self.world_size) * p[0].numel() for p in block.parameters())
            for block in reversed(list(model))
        ]
        self.assertEqual(seen, shard_numels * 2)

    def _check_grads_scaled(self, ref_model: nn.Module, model: nn.Module, scale: float) -> list:
        """Two backwards against DDP's: sharded grads must be DDP's times ``scale``.

        Returns the reduce-scatter ops, in issue order.
        """
        ddp_model = DistributedDataParallel(ref_model)
        ops = []
        with observe_reduce_scatters(lambda output, input, op, group: ops.append(op)):
            for iteration in range(2):  # the second backward accumulates into the first's
                inputs = make_inputs(iteration, self.rank)
                ddp_model(inputs).sum().backward()
                model(inputs).sum().backward()
                for name, param in model.named_parameters():
                    expected = _expected_shard(ref_model.get_parameter(name).grad * scale, param)
                    torch.testing.assert_close(param.grad.to_local(), expected, msg=name)
        return ops


class TestFullyShardGradients(GradientChecks, FSDPTestMultiThread):
    """Gradient accumulation and the knobs that act on backward and on reductions."""

    @property
    def world_size(self) -> int:
        return 2

    def test_accumulate_with_gradient_sync(self):
        self.check_accumulate_with_gradient_sync()

    def test_accumulate_without_gradient_sync(self):
        self.run_subtests(
            {"reshard_after_backward": [True, False]}, self.check_accumulate_without_sync
        )

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
            make_inputs,
            num_steps=2,
            num_microbatches=3,
            no_sync=not_last,
        )

    def test_unshard_in_backward(self):
        self.run_subtests({"unshard_in_backward": [True, False]}, self._test_unshard_in_backward)

    def _test_unshard_in_backward(self, unshard_in_backward: bool):
        # An embedding's backward needs the token ids, not its weight, so the embedding need
        # not be gathered again in backward.
        ref_model, model = reference_and_model(nn.Sequential(nn.Embedding(16, 8), MLP(8), MLP(8)))
        shard_bottom_up(model, model)
        model[0].set_unshard_in_backward(unshard_in_backward)
        num_steps = 2
        with count_all_gathers() as count:
            check_train_parity(self, ref_model, model, random_tokens(16, 2, 4), num_steps=num_steps)
        per_step = 3 + (3 if unshard_in_backward else 2)  # forward + backward
        self.assertEqual(count[0], num_steps * per_step)

    def test_reduce_scatter_unused_params_used_on_some_ranks(self):
        self.check_reduce_scatter_unused_params_used_on_some_ranks()

    def test_reduce_scatter_unused_params_unused_everywhere(self):
        # DDP leaves a parameter unused on every rank without a gradient; FSDP reduces zeros
        # for it (as torch's FSDP2 does), and the optimizer step leaves it unchanged alike.
        ref_model, model = reference_and_model(DoubleLinear(8, use_second_linear=False))
        fully_shard(model)
        model.set_reduce_scatter_unused_params(True)
        ddp_model = DistributedDataParallel(ref_model, find_unused_parameters=True)
        inputs = make_inputs(0, self.rank)
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
        self.run_subtests({"factor": factors}, self.check_gradient_divide_factor)

    def test_force_sum_reduction_for_comms(self):
        self.check_force_sum_reduction_for_comms()

    def test_all_reduce_hook(self):
        self.check_all_reduce_hook()


class TestFullyShardGradientsWorldSize4(TestFullyShardGradients):
    @property
    def world_size(self) -> int:
        return 4


class _RecordDivisions(TorchDispatchMode):
    """Record every division and multiplication op run under it, by overload."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("div", "div_", "mul", "mul_"):
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


class TestFullyShardGradientsOneRank(FSDPTestMultiThread):
    """With one rank the reduce-scatter is a copy: a divide factor divides in that copy."""

    @property
    def world_size(self) -> int:
        return 1

    def test_divide_factor_divides_once_in_the_copy(self):
        self.run_subtests({"factor": [None, 1.0, 2.0, 3.0]}, self._test_divide_factor_one_rank)

    def _test_divide_factor_one_rank(self, factor: float | None):
        model = nn.Linear(8, 4, bias=False)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        hook_saw = []
        model.set_all_reduce_hook(lambda reduced: hook_saw.append(reduced.clone()))
        loss = model(torch.ones(3, 8)).sum()
        with _RecordDivisions() as record:
            loss.backward()
        # torch's fully_shard divides out of place, once, when it copies the one rank's
        # gradient into the reduced output: the hook then sees the divided gradient, as it
        # does where the collective divides (PREMUL_SUM, AVG).
        divides = factor is not None and factor != 1
        self.assertEqual(record.ops, [torch.ops.aten.div.Tensor] if divides else [])
        expected = torch.full((4, 8), 3 / (factor or 1))
        torch.testing.assert_close(model.weight.grad.to_local(), expected)
        torch.testing.assert_close(hook_saw, [expected.view(-1)])
