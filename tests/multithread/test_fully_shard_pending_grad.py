"""The gradient a backward without sync leaves pending, as a user sees it.

See [Note: the pending gradient] in ``reffsdp/per_param/sharded_param.py``: it stays on the
unsharded parameter, so ``unshard()`` shows it as ``weight.grad``, in the reduce dtype, and
what the user does to it is what the next synced backward reduces. Each case runs torch's
``fully_shard`` on a copy of the same model with the same inputs and edits.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import reffsdp
from reffsdp.core.compat import TORCH_VERSION
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread

BF16, FP32 = torch.bfloat16, torch.float32
OURS = SimpleNamespace(
    name="reffsdp", fully_shard=reffsdp.fully_shard, mp=reffsdp.MixedPrecisionPolicy
)
THEIRS = SimpleNamespace(
    name="torch", fully_shard=torch_fsdp.fully_shard, mp=torch_fsdp.MixedPrecisionPolicy
)
# torch's fully_shard shows a pending gradient it keeps wider than the compute dtype only
# from 2.15 (before, it keeps it aside); reffsdp shows it on every release.
TORCH_SHOWS_WIDER_PENDING = TORCH_VERSION >= (2, 15)


def two_linears() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 4, bias=False))


class TestPendingGradient(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def shard(self, api, model: nn.Sequential, mp_kwargs: dict) -> nn.Module:
        mesh = init_device_mesh("cpu", (self.world_size,))
        kwargs = {"mesh": mesh, "mp_policy": api.mp(**mp_kwargs)}
        for layer in model:
            api.fully_shard(layer, **kwargs)
        return api.fully_shard(model, **kwargs)

    def twins(self, mp_kwargs: dict) -> tuple[nn.Module, nn.Module]:
        model = two_linears()
        self.sync_module_states(model)
        twin = copy.deepcopy(model)
        return self.shard(OURS, model, mp_kwargs), self.shard(THEIRS, twin, mp_kwargs)

    def backward(self, model: nn.Module, step: int, *, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + self.rank))
        model(x).sum().backward()

    def test_unshard_shows_the_pending_gradient_like_torch(self):
        self.run_subtests(
            {
                "mp_kwargs": [
                    {},
                    {"param_dtype": BF16},
                    {"param_dtype": BF16, "reduce_dtype": FP32},
                ]
            },
            self._check_shown,
        )

    def _check_shown(self, mp_kwargs: dict):
        models = self.twins(mp_kwargs)
        shown = []
        for model in models:
            self.backward(model, 0, sync=False)
            self.backward(model, 1, sync=False)
            layer = model[0]
            layer.unshard()
            grad = layer.weight.grad
            shown.append(grad)
            layer.reshard()
        ours, theirs = shown
        self.assertIsNotNone(ours)
        self.assertNotIsInstance(ours, DTensor)  # this rank's own, whole, unreduced
        self.assertEqual(ours.shape, (6, 4))
        wider = mp_kwargs.get("reduce_dtype") == FP32
        kept_dtype = FP32 if wider or not mp_kwargs or TORCH_VERSION >= (2, 15) else BF16
        self.assertEqual(ours.dtype, kept_dtype)
        if wider and not TORCH_SHOWS_WIDER_PENDING:
            self.assertIsNone(theirs)  # torch keeps it aside before 2.15
        else:
            self.assertEqual(theirs.dtype, ours.dtype)
            self.assertTrue(torch.equal(ours, theirs))

    def test_edits_of_the_pending_gradient_are_reduced_like_torch(self):
        self.run_subtests(
            {"mp_kwargs": [{}, {"param_dtype": BF16}], "edit": ["scale", "zero", "replace"]},
            self._check_edits,
        )

    def _check_edits(self, mp_kwargs: dict, edit: str):
        models = self.twins(mp_kwargs)
        for model in models:
            self.backward(model, 0, sync=False)
            layer = model[1]
            layer.unshard()
            grad = layer.weight.grad
            if edit == "scale":
                grad.mul_(3)
            elif edit == "zero":
                grad.zero_()
            else:
                layer.weight.grad = torch.full_like(grad, 0.5)
            layer.reshard()
            self.backward(model, 1, sync=True)
        for (name, ours), (_, theirs) in zip(*(m.named_parameters() for m in models)):
            self.assertTrue(torch.equal(ours.grad.to_local(), theirs.grad.to_local()), name)

    def test_wider_pending_gradient_reduces_like_torch(self):
        # bf16 compute, fp32 reduction: the pending gradient adds up in fp32 on both sides
        # (torch before 2.15 keeps it aside, reffsdp on the parameter); the results agree.
        models = self.twins({"param_dtype": BF16, "reduce_dtype": FP32})
        for model in models:
            for step, sync in enumerate((False, False, True)):
                self.backward(model, step, sync=sync)
        for (name, ours), (_, theirs) in zip(*(m.named_parameters() for m in models)):
            self.assertEqual(ours.grad.dtype, FP32)
            self.assertTrue(torch.equal(ours.grad.to_local(), theirs.grad.to_local()), name)
        # and afterwards the unsharded parameters take bf16 gradients again
        for model in models:
            self.backward(model, 3, sync=True)
        for (name, ours), (_, theirs) in zip(*(m.named_parameters() for m in models)):
            self.assertTrue(torch.equal(ours.grad.to_local(), theirs.grad.to_local()), name)
