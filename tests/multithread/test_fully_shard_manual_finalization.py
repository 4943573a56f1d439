"""``set_manual_backward_finalization`` and ``finalize_backward``: the caller ends backward.

With manual finalization the end of autograd's backward no longer ends FSDP's backward
iteration: a group that backward never left (the root's, whose input needs no gradient)
stays unsharded with its gradients unreduced until ``finalize_backward()``, which reduces
them, reshards and waits; with ``async_op=True`` the returned handle's ``wait()`` does the
waiting. Training this way gives the gradients of the automatic path bit for bit, and those
of DDP. The misuses torch 2.15 refuses are refused with the same error types (compared with
torch itself in ``tests/multiprocess/test_fully_shard_2_15_gloo.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from reffsdp import GradientReductionHandle, share_comm_ctx
from reffsdp.core.comms import Collective
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLPBlocks
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_sharded_parity, sum_loss

pytestmark = pytest.mark.multithread

make_inputs = random_inputs(2, 8)
RS = Collective.REDUCE_SCATTER


def shard_blocks(model: MLPBlocks, **kwargs) -> MLPBlocks:
    """Each of ``model.layers``, then the root, which keeps ``proj``: the root's group never
    sees a post-backward hook, since the model's input needs no gradient."""
    return shard_bottom_up(model, model.layers, **kwargs)


def assert_same_shards(test: FSDPTestMultiThread, model: nn.Module, other: nn.Module) -> None:
    """Bit for bit the same local shards, of parameters and of gradients."""
    for (name, param), (_, twin) in zip(model.named_parameters(), other.named_parameters()):
        test.assertTrue(torch.equal(param.to_local(), twin.to_local()), name)
        test.assertIsNotNone(param.grad, name)
        test.assertTrue(torch.equal(param.grad.to_local(), twin.grad.to_local()), name)


def run_in_backward(model: MLPBlocks, fn, x: torch.Tensor) -> torch.Tensor:
    """``model(x)``, with ``fn()`` called in its backward once backward has left the last
    layer (so FSDP's backward has started)."""

    def call_fn_in_backward(module: nn.Module, args: tuple[torch.Tensor]) -> None:
        args[0].register_hook(lambda grad: fn())

    hook = model.layers[-1].register_forward_pre_hook(call_fn_in_backward)
    try:
        return model(x)
    finally:
        hook.remove()


class ManualFinalizationChecks:
    """Test bodies the gloo suite runs too, in
    ``tests/multiprocess/test_fully_shard_2_15_gloo.py``."""

    def check_trains_like_ddp(self, async_op: bool, reshard_after_forward: bool):
        ref_model, model = reference_and_model(MLPBlocks(8))
        automatic = shard_blocks(copy.deepcopy(ref_model), reshard_after_forward=True)
        shard_blocks(model, reshard_after_forward=reshard_after_forward)
        model.set_manual_backward_finalization(True)
        ddp = DDP(ref_model)
        models = (ddp, model, automatic)
        optims = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in models]
        for step in range(3):
            x = make_inputs(step, self.rank)
            losses = [sum_loss(m(x)) for m in models]
            for loss in losses:
                loss.backward()
            self.assertEqual(losses[1].item(), losses[2].item())
            # Backward never left the root's group: it waits, unsharded, for finalization.
            self.assertNotIsInstance(model.proj.weight, DTensor)
            self.assertIsInstance(automatic.proj.weight, DTensor)
            handle = model.finalize_backward(async_op=async_op)
            if async_op:
                self.assertIsInstance(handle, GradientReductionHandle)
                handle.wait()
            else:
                self.assertIsNone(handle)
            self.assertIsInstance(model.proj.weight, DTensor)
            check_sharded_parity(self, ref_model, model)
            assert_same_shards(self, model, automatic)
            for optim in optims:
                optim.step()
                optim.zero_grad()

    def check_accumulate_without_sync_then_finalize_once(self):
        ref_model, model = reference_and_model(MLPBlocks(8))
        automatic = shard_blocks(copy.deepcopy(ref_model))
        shard_blocks(model)
        model.set_manual_backward_finalization(True)
        model.set_requires_gradient_sync(False)
        with CommCounter() as during_backward:
            for i in range(3):
                sum_loss(model(make_inputs(i, self.rank))).backward()
        model.set_requires_gradient_sync(True)
        with CommCounter() as at_finalization:
            model.finalize_backward()
        self.assertEqual(during_backward.get_comm_counts()[RS], 0)
        self.assertEqual(at_finalization.get_comm_counts()[RS], 3)  # two layers and the root

        for i in range(3):  # the usual way: sync the last backward only
            automatic.set_requires_gradient_sync(i == 2)
            sum_loss(automatic(make_inputs(i, self.rank))).backward()
        assert_same_shards(self, model, automatic)


class TestManualFinalization(ManualFinalizationChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_trains_like_ddp_and_like_the_automatic_path(self):
        self.run_subtests(
            {"async_op": [False, True], "reshard_after_forward": [True, False]},
            self.check_trains_like_ddp,
        )

    def test_accumulate_without_sync_then_finalize_once(self):
        self.check_accumulate_without_sync_then_finalize_once()

    def test_mode_is_latched_when_backward_starts(self):
        _, model = reference_and_model(MLPBlocks(8))
        shard_blocks(model)
        x = make_inputs(0, self.rank)
        model.set_manual_backward_finalization(True)
        sum_loss(model(x)).backward()
        with self.assertRaisesRegex(RuntimeError, "cannot change mode after backward starts"):
            model.set_manual_backward_finalization(False)
        model.set_manual_backward_finalization(True)  # no change: fine
        model.finalize_backward()
        model.set_manual_backward_finalization(False)
        sum_loss(model(x)).backward()  # automatic again: the root's group is reduced
        self.assertIsInstance(model.proj.weight.grad, DTensor)
        with self.assertRaisesRegex(RuntimeError, r"set_manual_backward_finalization\(True\)"):
            model.finalize_backward()

    def test_misuse_is_refused(self):
        _, model = reference_and_model(MLPBlocks(8))
        shard_blocks(model)
        x = make_inputs(0, self.rank)
        # Before the first forward there is nothing to finalize.
        self.assertIsNone(model.finalize_backward())
        model.finalize_backward(async_op=True).wait()
        with self.assertRaisesRegex(TypeError, "bool"):
            model.set_manual_backward_finalization(1)

        model.layers[0].set_manual_backward_finalization(True)  # before lazy init: allowed
        with self.assertRaisesRegex(RuntimeError, "must be called on the root"):
            model(x)  # ... but lazy init refuses it
        model.layers[0].set_manual_backward_finalization(False)
        sum_loss(model(x)).backward()
        with self.assertRaisesRegex(RuntimeError, "must be called on the root"):
            model.layers[0].set_manual_backward_finalization(True)

        model.set_manual_backward_finalization(True)
        sum_loss(model(x)).backward()
        with self.assertRaisesRegex(RuntimeError, "finalize_backward must be called on the root"):
            model.layers[1].finalize_backward()
        model.finalize_backward()

        for misuse, message in [
            (lambda: model.set_manual_backward_finalization(False), "during backward"),
            (lambda: model.finalize_backward(), "after backward completes"),
        ]:
            with self.assertRaisesRegex(RuntimeError, message):
                sum_loss(run_in_backward(model, misuse, x)).backward()
            model.reset_iter_state()

    def test_async_handle(self):
        ref_model, model = reference_and_model(MLPBlocks(8))
        shard_blocks(model)
        model.set_manual_backward_finalization(True)
        # Keep reductions in flight until something completes them (on CPU they complete at
        # once by default): here, only the handle's wait().
        model.set_reduce_scatter_max_input_buffers(4)
        x = make_inputs(0, self.rank)
        sum_loss(model(x)).backward()
        handle = model.finalize_backward(async_op=True)
        self.assertIsNone(model.layers[0].in_proj.weight.grad)
        with self.assertRaisesRegex(RuntimeError, "waited on before forward"):
            model(x)
        with self.assertRaisesRegex(RuntimeError, "waited on before finalizing backward again"):
            model.finalize_backward()
        handle.wait()
        handle.wait()  # nothing left to do
        ddp = DDP(ref_model)
        sum_loss(ddp(x)).backward()
        check_sharded_parity(self, ref_model, model)

        # reset_iter_state() drops the reduction, and the handle then refuses to wait.
        model.zero_grad()
        sum_loss(model(x)).backward()
        handle = model.finalize_backward(async_op=True)
        model.reset_iter_state()
        with self.assertRaisesRegex(RuntimeError, "handle was invalidated"):
            handle.wait()
        sum_loss(model(x)).backward()  # the next iteration runs as usual
        model.finalize_backward()
        self.assertIsInstance(model.proj.weight.grad, DTensor)

    def test_roots_sharing_a_comm_ctx_wait_for_each_other(self):
        _, first = reference_and_model(MLPBlocks(8))
        _, second = reference_and_model(MLPBlocks(8))
        share_comm_ctx([shard_blocks(first), shard_blocks(second)])
        x = make_inputs(0, self.rank)
        for model in (first, second):
            model.set_manual_backward_finalization(True)
            model.set_reduce_scatter_max_input_buffers(4)
        sum_loss(first(x)).backward()
        sum_loss(second(x)).backward()  # its reductions stay in flight
        with self.assertRaisesRegex(RuntimeError, "reductions of another FSDP root"):
            first.finalize_backward(async_op=True)  # its wait would complete the second's
        second.finalize_backward()
        handle = first.finalize_backward(async_op=True)
        with self.assertRaisesRegex(RuntimeError, "waited on before forward"):
            second(x)
        with self.assertRaisesRegex(RuntimeError, "(?i)another gradient reduction sharing"):
            second.finalize_backward()
        with self.assertRaisesRegex(RuntimeError, "owned by another FSDP root"):
            second.reset_iter_state()
        handle.wait()
        sum_loss(second(x)).backward()
        second.finalize_backward()

    def test_hsdp_needs_the_all_reduce_before_finalization(self):
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        _, model = reference_and_model(MLPBlocks(8))
        shard_blocks(model, mesh=mesh)
        model.set_manual_backward_finalization(True)
        x = make_inputs(0, self.rank)

        model.set_requires_all_reduce(False)  # the layers' reductions wait for an all-reduce
        sum_loss(model(x)).backward()
        with self.assertRaisesRegex(RuntimeError, "partial gradient reductions"):
            model.finalize_backward()
        model.reset_iter_state()

        model.set_requires_all_reduce(True)
        sum_loss(model(x)).backward()
        model.set_requires_all_reduce(False)  # the root's pending reduction would be partial
        with self.assertRaisesRegex(RuntimeError, r"set_requires_all_reduce\(True\)"):
            model.finalize_backward()
        model.set_requires_all_reduce(True)
        model.finalize_backward()
        self.assertIsInstance(model.proj.weight.grad, DTensor)
