"""``ShardedGradScaler``: every rank skips the step when any rank's gradient shard has an inf.

Plain (per-rank) gradients stand in for sharded ones where the test plants values by hand;
``fully_shard`` models give real ``DTensor`` gradients, ``FullyShardedDataParallel`` models
flat ones (or 1-D views of them, with ``use_orig_params=True``). torch's own
``ShardedGradScaler`` is the reference for the scale, the growth tracker and the steps taken.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.distributed.tensor import DTensor

from reffsdp import FullyShardedDataParallel, fully_shard
from reffsdp.core.comms import Collective
from reffsdp.sharded_grad_scaler import ShardedGradScaler
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread

INF_RANK = 1


def _params_with_grads(rank: int, plant_inf: bool, dtype=torch.float32) -> list[nn.Parameter]:
    """Two parameters with gradients of 8.0 (a scaled 1.0 at scale 8); an inf on INF_RANK."""
    params = [nn.Parameter(torch.zeros(3, dtype=dtype)), nn.Parameter(torch.zeros(2, dtype=dtype))]
    for param in params:
        param.grad = torch.full_like(param, 8.0)
    if plant_inf and rank == INF_RANK:
        params[1].grad[0] = float("inf")
    return params


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=0, atol=0)


def _start(scaler) -> None:
    """A scaler creates its scale lazily, at the first ``scale()``."""
    scaler.scale(torch.ones(()))


class TestShardedGradScaler(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_inf_on_one_rank_skips_the_step_everywhere(self):
        self.run_subtests(
            {"scaler_cls": [ShardedGradScaler, TorchShardedGradScaler]}, self._test_inf_skips
        )

    def _test_inf_skips(self, scaler_cls):
        params = _params_with_grads(self.rank, plant_inf=True)
        optim = torch.optim.SGD(params, lr=1.0)
        scaler = scaler_cls(device="cpu", init_scale=8.0, growth_interval=1)
        _start(scaler)
        scaler.step(optim)
        scaler.update()
        for param in params:  # no rank stepped, not even the one whose shard was finite
            _assert_same(param, torch.zeros_like(param))
        self.assertEqual(scaler.get_scale(), 4.0)  # backed off on every rank
        self.assertEqual(scaler._get_growth_tracker(), 0)

    def test_a_plain_grad_scaler_would_diverge(self):
        """The failure the sharded scaler prevents: each rank decides alone."""
        params = _params_with_grads(self.rank, plant_inf=True)
        scaler = torch.amp.GradScaler(device="cpu", init_scale=8.0)
        _start(scaler)
        scaler.step(torch.optim.SGD(params, lr=1.0))
        stepped = not torch.equal(params[0].detach(), torch.zeros(3))
        self.assertEqual(stepped, self.rank != INF_RANK)

    def test_finite_grads_step_and_grow_like_torch(self):
        """Several steps, some with an inf, against torch's sharded scaler."""
        ours, theirs = self._scaler_pair(growth_interval=2)
        for step, plant_inf in enumerate([False, False, True, False, False, False]):
            results = []
            for scaler in (ours, theirs):
                params = _params_with_grads(self.rank, plant_inf, dtype=torch.float16)
                scaler.scale(torch.ones(()))
                scaler.unscale_(optim := torch.optim.SGD(params, lr=0.5))
                found_inf = sum(v.item() for v in scaler._found_inf_per_device(optim).values())
                scaler.step(optim)
                scaler.update()
                results.append(
                    (found_inf > 0, scaler.get_scale(), scaler._get_growth_tracker(), params)
                )
            (our_inf, our_scale, our_tracker, ours_p), (inf, scale, tracker, theirs_p) = results
            self.assertEqual((our_inf, our_scale, our_tracker), (inf, scale, tracker), step)
            self.assertEqual(our_inf, plant_inf)
            for ours_param, theirs_param in zip(ours_p, theirs_p):
                _assert_same(ours_param, theirs_param)
        self.assertEqual(ours.get_scale(), 2.0**4 * 2)  # 16 -> 32 -> 16 -> 32

    def _scaler_pair(self, **kwargs):
        return (
            ShardedGradScaler(device="cpu", init_scale=16.0, **kwargs),
            TorchShardedGradScaler(device="cpu", init_scale=16.0, **kwargs),
        )

    def test_a_rank_without_grads_still_takes_part(self):
        params = _params_with_grads(self.rank, plant_inf=True)
        if self.rank != INF_RANK:
            for param in params:
                param.grad = None
        scaler = ShardedGradScaler(device="cpu", init_scale=8.0)
        _start(scaler)
        with CommCounter() as counter:
            scaler.step(torch.optim.SGD(params, lr=1.0))
        scaler.update()
        self.assertEqual(counter.get_comm_counts()[Collective.ALL_REDUCE], 1)
        self.assertEqual(scaler.get_scale(), 4.0)

    def test_fused_optimizer_agrees_too(self):
        """Fused optimizers take ``step()``'s other path (no unscale_); it agrees as well."""
        params = _params_with_grads(self.rank, plant_inf=True)
        optim = torch.optim.Adam(params, lr=1.0, fused=True)
        scaler = ShardedGradScaler(device="cpu", init_scale=8.0)
        _start(scaler)
        scaler.step(optim)
        scaler.update()
        for param in params:
            _assert_same(param, torch.zeros_like(param))
        self.assertEqual(scaler.get_scale(), 4.0)

    def test_fully_shard_training_matches_an_unscaled_run(self):
        """Power-of-two scales unscale exactly, so scaled training equals unscaled training."""
        model = MLPStack(8)
        self.sync_module_states(model)
        ref = copy.deepcopy(model)
        for module in (model, ref):
            for block in module:
                fully_shard(block)
            fully_shard(module)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
        scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=1)
        make_inputs = random_inputs(2, 8)
        for iteration in range(3):
            inputs = make_inputs(iteration, self.rank)
            scaler.scale(model(inputs).sum()).backward()
            self.assertIsInstance(next(model.parameters()).grad, DTensor)
            scaler.step(optim)
            scaler.update()
            ref(inputs).sum().backward()
            ref_optim.step()
            for optimizer in (optim, ref_optim):
                optimizer.zero_grad()
            for param, ref_param in zip(model.parameters(), ref.parameters()):
                _assert_same(param.to_local(), ref_param.to_local())
        self.assertEqual(scaler.get_scale(), 2.0**13)  # grew after each finite step

    def test_inf_in_one_dtensor_shard_skips_everywhere(self):
        model = MLPStack(8)
        self.sync_module_states(model)
        for block in model:
            fully_shard(block)
        fully_shard(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler(device="cpu", init_scale=4.0)
        scaler.scale(model(random_inputs(2, 8)(0, self.rank)).sum()).backward()
        before = [param.to_local().clone() for param in model.parameters()]
        grad = next(model.parameters()).grad.to_local()
        if self.rank == INF_RANK:
            grad.view(-1)[0] = float("nan")
        with CommCounter() as counter:
            scaler.step(optim)
        scaler.update()
        # One all-reduce in all: unscaling the local shards keeps DTensor from reducing each
        # foreach call's flag on its own.
        self.assertEqual(counter.get_comm_counts()[Collective.ALL_REDUCE], 1)
        for param, old in zip(model.parameters(), before):
            _assert_same(param.to_local(), old)
        self.assertEqual(scaler.get_scale(), 2.0)

    def test_wrapper_training_matches_an_unscaled_run(self):
        """The wrapper's flat gradients (and, with ``use_orig_params``, its 1-D views, some
        of them empty) unscale exactly too."""
        self.run_subtests({"use_orig_params": [False, True]}, self._test_wrapper_scaled)

    def _test_wrapper_scaled(self, use_orig_params):
        model, ref = self._wrapped_pair(use_orig_params)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
        scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=1)
        make_inputs = random_inputs(2, 8)
        for iteration in range(3):
            inputs = make_inputs(iteration, self.rank)
            scaler.scale(model(inputs).sum()).backward()
            scaler.step(optim)
            scaler.update()
            ref(inputs).sum().backward()
            ref_optim.step()
            for optimizer in (optim, ref_optim):
                optimizer.zero_grad()
            for param, ref_param in zip(model.parameters(), ref.parameters()):
                _assert_same(param, ref_param)
        self.assertEqual(scaler.get_scale(), 2.0**13)

    def test_inf_in_one_wrapper_shard_skips_everywhere(self):
        self.run_subtests({"use_orig_params": [False, True]}, self._test_wrapper_inf)

    def _test_wrapper_inf(self, use_orig_params):
        model, _ = self._wrapped_pair(use_orig_params)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler(device="cpu", init_scale=4.0)
        scaler.scale(model(random_inputs(2, 8)(0, self.rank)).sum()).backward()
        before = [param.detach().clone() for param in model.parameters()]
        if self.rank == INF_RANK:
            grad = next(p.grad for p in model.parameters() if p.grad is not None and p.numel())
            grad.view(-1)[-1] = float("inf")
        with CommCounter() as counter:
            scaler.step(optim)
        scaler.update()
        self.assertEqual(counter.get_comm_counts()[Collective.ALL_REDUCE], 1)
        for param, old in zip(model.parameters(), before):
            _assert_same(param, old)
        self.assertEqual(scaler.get_scale(), 2.0)

    def _wrapped_pair(self, use_orig_params: bool):
        """Two identical wrapped ``MLPStack`` s: a block per instance, plus the root."""
        model = MLPStack(8)
        self.sync_module_states(model)
        ref = copy.deepcopy(model)
        wrapped = []
        for module in (model, ref):
            for index in range(len(module)):
                module[index] = FullyShardedDataParallel(
                    module[index], use_orig_params=use_orig_params
                )
            wrapped.append(FullyShardedDataParallel(module, use_orig_params=use_orig_params))
        return wrapped[0], wrapped[1]


def test_scale_keeps_the_output_dtype():
    scaler = ShardedGradScaler(device="cpu", init_scale=4.0)
    loss = torch.tensor(1.5, dtype=torch.float16)
    scaled = scaler.scale(loss)
    assert scaled.dtype == torch.float16 and scaled.item() == 6.0
    nested = scaler.scale([loss, (torch.ones(2, dtype=torch.bfloat16),)])
    assert nested[0].dtype == torch.float16 and nested[1][0].dtype == torch.bfloat16
    assert list(nested[1][0]) == [4.0, 4.0]
    lazy = scaler.scale(iter([torch.ones(1)]))
    assert [t.item() for t in lazy] == [4.0]
    with pytest.raises(ValueError, match="Tensor or an iterable"):
        scaler.scale(3.0)


def test_disabled_scaler_passes_through():
    scaler = ShardedGradScaler(device="cpu", enabled=False)
    loss = torch.ones(())
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0


def test_signature_matches_torch():
    ours = inspect.signature(ShardedGradScaler.__init__).parameters
    theirs = inspect.signature(TorchShardedGradScaler.__init__).parameters
    assert [(p.name, p.default, p.kind) for p in ours.values()] == [
        (p.name, p.default, p.kind) for p in theirs.values()
    ]
