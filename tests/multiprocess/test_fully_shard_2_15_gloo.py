"""What torch 2.15 added to ``fully_shard``, over real gloo processes, next to torch's own.

reffsdp offers these additions on every supported torch; ``TestAdditionsGloo`` runs the
threaded suites' main bodies on gloo on any of them. ``TestAdditionsMatchTorch`` needs a
torch that has the additions itself (2.15 and newer) and runs each scenario twice, once
with reffsdp and once with torch's ``fully_shard``, on copies of one model:

* manual backward finalization (synchronous, asynchronous, after microbatches without
  gradient sync): the same losses, gradients and parameters bit for bit, and the same
  collectives (count and bytes) in backward and at finalization;
* every misuse torch refuses: the same exception type, with the same key facts;
* ``reduce_dtype=None`` with ``param_dtype`` set, and ``param_dtype_override_fn`` (one group
  of fp32 and bf16 gradients): the same bytes all-gathered and reduce-scattered, and the
  same results bit for bit;
* ``set_keep_unsharded_storage(True)``: stable data pointers on both sides.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import reffsdp
from reffsdp.core.compat import TORCH_VERSION
from reffsdp.testing.build import reference_and_model
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.models import MLP, MLPBlocks
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.parity import sum_loss
from tests.multithread.test_fully_shard_dtypes_and_storage import (
    ReduceDtypeChecks,
    Scale,
    ScaledMLP,
    keep_scales_in_own_dtype,
    scaled_mlps,
)
from tests.multithread.test_fully_shard_manual_finalization import (
    ManualFinalizationChecks,
    run_in_backward,
)

pytestmark = pytest.mark.multiprocess

DIM = 8
BF16 = torch.bfloat16

OURS = SimpleNamespace(
    name="reffsdp",
    fully_shard=reffsdp.fully_shard,
    MixedPrecisionPolicy=reffsdp.MixedPrecisionPolicy,
    share_comm_ctx=reffsdp.share_comm_ctx,
)
THEIRS = SimpleNamespace(
    name="torch",
    fully_shard=torch_fsdp.fully_shard,
    MixedPrecisionPolicy=torch_fsdp.MixedPrecisionPolicy,
    share_comm_ctx=torch_fsdp.share_comm_ctx,
)


def inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def shard(api: SimpleNamespace, model: nn.Module, policy_kwargs=None, **kwargs) -> nn.Module:
    """``api.fully_shard`` on each block of ``model`` (its ``MLP`` / ``ScaledMLP`` children,
    or ``layers``), then on ``model``, all with the same arguments."""
    if policy_kwargs is not None:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(**policy_kwargs)
    blocks = model.layers if isinstance(model, MLPBlocks) else list(model)
    for block in blocks:
        if isinstance(block, (MLP, ScaledMLP)):
            api.fully_shard(block, **kwargs)
    return api.fully_shard(model, **kwargs)


class TestAdditionsGloo(ManualFinalizationChecks, ReduceDtypeChecks, FSDPTest):
    """reffsdp alone, on any supported torch."""

    @property
    def world_size(self) -> int:
        return 2

    def test_manual_finalization_and_reduce_dtype(self):
        self.check_trains_like_ddp(async_op=True, reshard_after_forward=True)
        self.check_accumulate_without_sync_then_finalize_once()
        self.check_reduce_dtype_follows_the_installed_torch()
        self.check_mixed_gradient_dtypes_reduce_in_the_promoted_dtype()


@pytest.mark.skipif(
    TORCH_VERSION < (2, 15), reason="torch's fully_shard has these additions from 2.15"
)
class TestAdditionsMatchTorch(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    # -- helpers ------------------------------------------------------------------------

    def twins(self, make_model: Callable[[], nn.Module], **shard_kwargs):
        """``(ours, theirs)``: one model (rank 0's weights), sharded by each API."""
        _, model = reference_and_model(make_model())
        theirs = copy.deepcopy(model)
        policy = shard_kwargs.pop("policy", None)
        for api, target in ((OURS, model), (THEIRS, theirs)):
            kwargs = dict(shard_kwargs)
            if policy is not None:
                kwargs["policy_kwargs"] = policy(target)
            shard(api, target, **kwargs)
        return model, theirs

    def assert_same_shards(self, ours: nn.Module, theirs: nn.Module) -> None:
        pairs = zip(ours.named_parameters(), theirs.named_parameters(), strict=True)
        for (name, param), (twin_name, twin) in pairs:
            self.assertEqual(name, twin_name)
            self.assertTrue(torch.equal(param.to_local(), twin.to_local()), name)
            self.assertEqual(param.grad is None, twin.grad is None, name)
            if param.grad is not None:
                grads = param.grad.to_local(), twin.grad.to_local()
                self.assertEqual(grads[0].dtype, grads[1].dtype, name)
                self.assertTrue(torch.equal(*grads), name)

    def assert_same_comms(self, ours: CommCounter, theirs: CommCounter, what: str) -> None:
        self.assertEqual(ours.get_comm_counts(), theirs.get_comm_counts(), what)
        self.assertEqual(ours.get_comm_bytes(), theirs.get_comm_bytes(), what)

    def assert_same_error(self, scenario: Callable[[SimpleNamespace], None], *facts: str):
        """``scenario(api)`` raises the same exception type for both, and each message
        holds every one of ``facts`` (case ignored)."""
        errors = {}
        for api in (OURS, THEIRS):
            with self.assertRaises(Exception, msg=f"{api.name}: {facts}") as caught:
                scenario(api)
            errors[api.name] = caught.exception
        self.assertIs(type(errors["reffsdp"]), type(errors["torch"]), errors)
        for name, error in errors.items():
            for fact in facts:
                self.assertIn(fact.lower(), str(error).lower(), f"{name}: {error}")

    def backward(
        self, model: nn.Module, x: torch.Tensor, losses: list[float], *, sync: bool = True
    ) -> CommCounter:
        """Forward and backward (with gradient sync as ``sync`` says); records the loss and
        returns what was communicated."""
        model.set_requires_gradient_sync(sync)
        with CommCounter() as counter:
            loss = sum_loss(model(x))
            loss.backward()
        losses.append(loss.item())
        return counter

    # -- manual backward finalization ----------------------------------------------------

    def test_manual_finalization_matches_torch(self):
        for async_op in (False, True):
            for microbatches in (1, 3):
                self.check_manual_finalization(async_op, microbatches)

    def check_manual_finalization(self, async_op: bool, microbatches: int):
        models = self.twins(lambda: MLPBlocks(DIM))
        losses: tuple[list[float], list[float]] = ([], [])
        for model in models:
            self.assertIsNone(model.finalize_backward())  # before any forward: a no-op
            model.finalize_backward(async_op=True).wait()
            model.set_manual_backward_finalization(True)
        optims = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in models]
        for step in range(2):
            counters = []
            for model, model_losses in zip(models, losses, strict=True):
                # Microbatches without gradient sync, the last with it, one finalization.
                backward = [
                    self.backward(model, inputs(10 * step + i, self.rank), model_losses, sync=last)
                    for i, last in enumerate([False] * (microbatches - 1) + [True])
                ]
                unsharded = not isinstance(model.proj.weight, DTensor)
                with CommCounter() as finalization:
                    handle = model.finalize_backward(async_op=async_op)
                    if async_op:
                        handle.wait()
                counters.append((backward, finalization, unsharded))
            (ours_bwd, ours_fin, ours_unsharded), (theirs_bwd, theirs_fin, theirs_unsharded) = (
                counters
            )
            self.assertTrue(ours_unsharded and theirs_unsharded)
            for i, (ours, theirs) in enumerate(zip(ours_bwd, theirs_bwd, strict=True)):
                self.assert_same_comms(ours, theirs, f"step {step}, backward {i}")
            self.assert_same_comms(ours_fin, theirs_fin, f"step {step}, finalize_backward")
            self.assertEqual(*losses)
            self.assert_same_shards(*models)
            for optim in optims:
                optim.step()
                optim.zero_grad()
        self.assert_same_shards(*models)

    def test_misuse_errors_match_torch(self):
        x = inputs(0, self.rank)

        def model_of(api: SimpleNamespace, manual: bool = True) -> nn.Module:
            model = shard(api, MLPBlocks(DIM))
            model.set_manual_backward_finalization(manual)
            return model

        def backward_then(api, manual: bool, then: Callable[[nn.Module], None]) -> None:
            model = model_of(api, manual)
            sum_loss(model(x)).backward()
            then(model)

        def child_set_before_lazy_init(api):
            model = shard(api, MLPBlocks(DIM))
            model.layers[0].set_manual_backward_finalization(True)
            model(x)

        def in_backward(api, fn: Callable[[nn.Module], None]) -> None:
            model = model_of(api)
            sum_loss(run_in_backward(model, lambda: fn(model), x)).backward()

        def pending_async(api, then: Callable[[nn.Module, object], None]) -> None:
            model = model_of(api)
            sum_loss(model(x)).backward()
            then(model, model.finalize_backward(async_op=True))

        def reset_then_wait(model, handle):
            model.reset_iter_state()
            handle.wait()

        check = self.assert_same_error
        check(
            lambda api: backward_then(api, False, lambda m: m.finalize_backward()),
            "finalize_backward",
            "set_manual_backward_finalization(True)",
        )
        check(
            lambda api: backward_then(
                api, False, lambda m: m.layers[0].set_manual_backward_finalization(True)
            ),
            "set_manual_backward_finalization must be called on the root",
        )
        check(child_set_before_lazy_init, "set_manual_backward_finalization must be called on")
        check(
            lambda api: backward_then(api, True, lambda m: m.layers[1].finalize_backward()),
            "finalize_backward must be called on the root",
        )
        check(
            lambda api: backward_then(
                api, True, lambda m: m.set_manual_backward_finalization(False)
            ),
            "cannot change mode after backward starts",
        )
        check(
            lambda api: in_backward(api, lambda m: m.set_manual_backward_finalization(False)),
            "cannot change mode during backward",
        )
        check(
            lambda api: in_backward(api, lambda m: m.finalize_backward()),
            "finalize_backward must be called after backward completes",
        )
        check(
            lambda api: pending_async(api, lambda m, handle: m(x)),
            "must be waited on before forward",
        )
        check(
            lambda api: pending_async(api, lambda m, handle: m.finalize_backward()),
            "must be waited on before finalizing backward again",
        )
        check(lambda api: pending_async(api, reset_then_wait), "handle was invalidated")
        self.check_shared_comm_ctx_errors(x)
        self.check_hsdp_errors(x)
        self.check_param_dtype_override_errors()

    def check_shared_comm_ctx_errors(self, x: torch.Tensor) -> None:
        def two_roots(api, then: Callable[[nn.Module, nn.Module], None]) -> None:
            first, second = shard(api, MLPBlocks(DIM)), shard(api, MLPBlocks(DIM))
            api.share_comm_ctx([first, second])
            for model in (first, second):
                model.set_manual_backward_finalization(True)
                model.set_reduce_scatter_max_input_buffers(4)
            sum_loss(first(x)).backward()
            sum_loss(second(x)).backward()  # its reductions stay in flight
            then(first, second)

        def second_waits(then: Callable[[nn.Module], None]):
            def scenario(first, second):
                second.finalize_backward()
                first.finalize_backward(async_op=True)
                then(second)

            return scenario

        check = self.assert_same_error
        check(
            lambda api: two_roots(api, lambda a, b: a.finalize_backward(async_op=True)),
            "asynchronous gradient finalization cannot overlap",
            "another FSDP root sharing the communication context",
        )
        check(
            lambda api: two_roots(api, second_waits(lambda b: b.finalize_backward())),
            "another gradient reduction sharing this communication context",
        )
        check(
            lambda api: two_roots(api, second_waits(lambda b: b.reset_iter_state())),
            "reset_iter_state cannot reset a gradient reduction owned by another FSDP root",
        )
        check(
            lambda api: two_roots(api, second_waits(lambda b: b(x))),
            "must be waited on before forward",
        )

    def check_hsdp_errors(self, x: torch.Tensor) -> None:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))

        def hsdp(api, all_reduce_in_backward: bool) -> None:
            model = shard(api, MLPBlocks(DIM), mesh=mesh)
            model.set_manual_backward_finalization(True)
            model.set_requires_all_reduce(all_reduce_in_backward)
            sum_loss(model(x)).backward()
            model.set_requires_all_reduce(False)
            model.finalize_backward()

        self.assert_same_error(
            lambda api: hsdp(api, False),
            "manual backward finalization does not support partial gradient reductions",
        )
        self.assert_same_error(
            lambda api: hsdp(api, True),
            "manual backward finalization requires all-reduce",
            "set_requires_all_reduce(True)",
        )

    def check_param_dtype_override_errors(self) -> None:
        def override(api, returned) -> None:
            policy = {"param_dtype": BF16, "param_dtype_override_fn": lambda p: returned}
            shard(api, nn.Sequential(MLP(DIM)), policy_kwargs=policy)

        self.assert_same_error(
            lambda api: override(api, "float32"),
            "param_dtype_override_fn must return a torch.dtype or None",
        )
        self.assert_same_error(
            lambda api: override(api, torch.float16),
            "param_dtype_override_fn",
            "None, param_dtype",
            "torch.float16",
        )

    # -- dtypes and storage ---------------------------------------------------------------

    def test_dtypes_match_torch(self):
        self.check_dtypes(lambda: MLPBlocks(DIM), lambda model: {"param_dtype": BF16})
        self.check_dtypes(
            scaled_mlps,
            lambda model: {
                "param_dtype": BF16,
                "param_dtype_override_fn": keep_scales_in_own_dtype(model),
            },
        )

    def check_dtypes(self, make_model, policy) -> None:
        """Unset reduce_dtype: the same bytes and results, microbatches without sync too."""
        models = self.twins(make_model, policy=policy)
        losses: tuple[list[float], list[float]] = ([], [])
        scale_dtypes: tuple[list[torch.dtype], list[torch.dtype]] = ([], [])
        for model, seen in zip(models, scale_dtypes, strict=True):
            for scale in [m for m in model.modules() if isinstance(m, Scale)]:
                scale.register_forward_pre_hook(
                    lambda module, args, seen=seen: seen.append(module.weight.dtype)
                )
        optims = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
        for step in range(2):
            counters = [
                [
                    self.backward(model, inputs(2 * step, self.rank), model_losses, sync=False),
                    self.backward(model, inputs(2 * step + 1, self.rank), model_losses),
                ]
                for model, model_losses in zip(models, losses, strict=True)
            ]
            for ours, theirs in zip(*counters, strict=True):
                self.assert_same_comms(ours, theirs, f"step {step}")
            self.assertEqual(*losses)
            self.assert_same_shards(*models)
            for optim in optims:
                optim.step()
                optim.zero_grad()
        self.assertEqual(*scale_dtypes)

    def test_keep_unsharded_storage_matches_torch(self):
        models = self.twins(lambda: MLPBlocks(DIM))
        losses: tuple[list[float], list[float]] = ([], [])
        pointers: tuple[list[int], list[int]] = ([], [])
        for model, seen in zip(models, pointers, strict=True):
            model.set_keep_unsharded_storage(True)
            model.layers[0].register_forward_pre_hook(
                lambda module, args, seen=seen: seen.append(module.in_proj.weight.data_ptr())
            )
        optims = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
        for step in range(3):
            for model, optim, model_losses in zip(models, optims, losses, strict=True):
                self.backward(model, inputs(step, self.rank), model_losses)
                optim.step()
                optim.zero_grad()
        for seen in pointers:
            self.assertEqual(len(seen), 3)
            self.assertEqual(len(set(seen)), 1, seen)
        self.assertEqual(*losses)
        for param, twin in zip(models[0].parameters(), models[1].parameters(), strict=True):
            self.assertTrue(torch.equal(param.to_local(), twin.to_local()))
