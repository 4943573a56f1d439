"""Per-parameter compute dtypes, the default reduce dtype, and keeping unsharded storage.

* ``MixedPrecisionPolicy(param_dtype_override_fn=...)`` keeps chosen parameters in their own
  dtype (here the weight of a norm-like scale, in fp32) while the rest compute in
  ``param_dtype``; forward inputs are still cast to ``param_dtype``.
* With ``reduce_dtype=None`` gradients are reduced, and kept while gradient sync is off, in
  the dtype the installed torch's ``fully_shard`` uses: the compute dtype up to 2.14, the
  parameter's own dtype from 2.15 (entry 5 of [Note: torch versions] in
  ``reffsdp/core/compat.py``). A group whose gradients differ in dtype reduces in the
  promoted dtype on every torch. The wrapper API reduces in ``param_dtype`` on every torch.
* ``set_keep_unsharded_storage(True)`` keeps the unsharded parameters' storage across
  reshards, so their data pointers never change.

``tests/multiprocess/test_fully_shard_2_15_gloo.py`` compares all of it with torch 2.15.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from reffsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard
from reffsdp.core.compat import TORCH_VERSION
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import Passthrough, check_train_parity, gradient_sync_off, sum_loss
from reffsdp.testing.patching import observe_reduce_scatters

pytestmark = pytest.mark.multithread

DIM = 8
make_inputs = random_inputs(2, DIM)
BF16 = torch.bfloat16
# What fully_shard reduces bf16-computed gradients of fp32 parameters in, unless told.
DEFAULT_REDUCE_DTYPE = torch.float32 if TORCH_VERSION >= (2, 15) else BF16


class Scale(nn.Module):
    """A norm-like elementwise scale that computes in fp32 and returns the input's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.weight).to(x.dtype)


class ScaledMLP(nn.Module):
    """A :class:`Scale`, then an :class:`MLP`: one group whose parameters may differ in dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = Scale(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.scale(x))


def scaled_mlps() -> nn.Sequential:
    return nn.Sequential(ScaledMLP(DIM), ScaledMLP(DIM), nn.Linear(DIM, DIM))


def keep_scales_in_own_dtype(model: nn.Module):
    """A ``param_dtype_override_fn`` keeping every :class:`Scale` weight of ``model`` as is."""
    kept = {id(m.weight) for m in model.modules() if isinstance(m, Scale)}
    return lambda param: param.dtype if id(param) in kept else None


def shard_scaled_mlps(model: nn.Sequential, **kwargs) -> nn.Sequential:
    return shard_bottom_up(model, [m for m in model if isinstance(m, ScaledMLP)], **kwargs)


class LowPrecisionExcept(nn.Module):
    """The reference for ``param_dtype_override_fn``: computes with every parameter and the
    input cast to ``param_dtype``, except the parameters named in ``keep``."""

    def __init__(self, module: nn.Module, param_dtype: torch.dtype, keep: set[str]) -> None:
        super().__init__()
        self.module = module
        self.param_dtype = param_dtype
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = {
            name: param if name in self.keep else param.to(self.param_dtype)
            for name, param in self.module.named_parameters()
        }
        return torch.func.functional_call(self.module, params, (x.to(self.param_dtype),))


def reduce_scatter_dtypes():
    """``(context manager, list)``: the input dtype of each reduce-scatter issued inside."""
    seen: list[torch.dtype] = []
    return observe_reduce_scatters(lambda output, input, op, group: seen.append(input.dtype)), seen


class TestParamDtypeOverride(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_kept_params_compute_in_their_dtype_and_train_like_the_reference(self):
        ref_model, model = reference_and_model(scaled_mlps())
        originals = list(model.parameters())
        keep, calls = keep_scales_in_own_dtype(model), []

        def keep_scales(param: nn.Parameter) -> torch.dtype | None:
            calls.append(param)
            return keep(param)

        policy = MixedPrecisionPolicy(
            param_dtype=BF16, reduce_dtype=torch.float32, param_dtype_override_fn=keep_scales
        )
        shard_scaled_mlps(model, mp_policy=policy)
        # Called by fully_shard, once for each original parameter.
        self.assertEqual(sorted(map(id, calls)), sorted(map(id, originals)))
        seen = []
        model[0].register_forward_pre_hook(
            lambda module, args: seen.append(
                (args[0].dtype, module.scale.weight.dtype, module.mlp.in_proj.weight.dtype)
            )
        )
        with torch.no_grad():
            model(make_inputs(0, self.rank))
        model.reshard()  # the root keeps its parameters unsharded after forward
        self.assertEqual(seen, [(BF16, torch.float32, BF16)])  # inputs still cast

        keep = {name for name, p in ref_model.named_parameters() if name.endswith("scale.weight")}
        reference = LowPrecisionExcept(ref_model, BF16, keep)
        check_train_parity(self, reference, Passthrough(model), make_inputs, num_steps=2)

    def test_override_returning_the_default_or_another_dtype(self):
        for returned in (None, BF16):  # both mean param_dtype
            model = fully_shard(
                ScaledMLP(DIM),
                mp_policy=MixedPrecisionPolicy(
                    param_dtype=BF16, param_dtype_override_fn=lambda p, r=returned: r
                ),
            )
            dtypes = []
            model.register_forward_pre_hook(
                lambda module, args, seen=dtypes: seen.append(module.scale.weight.dtype)
            )
            with torch.no_grad():
                model(make_inputs(0, self.rank))
            self.assertEqual(dtypes, [BF16])
        for returned, message in [
            (torch.float16, "may only return None, param_dtype or the parameter's own dtype"),
            ("float32", "must return a torch.dtype or None"),
        ]:
            policy = MixedPrecisionPolicy(
                param_dtype=BF16, param_dtype_override_fn=lambda p, r=returned: r
            )
            with self.assertRaisesRegex(ValueError, message):
                fully_shard(ScaledMLP(DIM), mp_policy=policy)


class ReduceDtypeChecks:
    """Test bodies the gloo suite runs too, in
    ``tests/multiprocess/test_fully_shard_2_15_gloo.py``."""

    def check_reduce_dtype_follows_the_installed_torch(self):
        _, model = reference_and_model(MLPStack(DIM))
        shard_bottom_up(model, model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
        observing, seen = reduce_scatter_dtypes()
        with observing:
            sum_loss(model(make_inputs(0, self.rank))).backward()
        self.assertEqual(seen, [DEFAULT_REDUCE_DTYPE] * 3)
        for name, param in model.named_parameters():
            self.assertEqual(param.grad.dtype, torch.float32, name)

    def check_mixed_gradient_dtypes_reduce_in_the_promoted_dtype(self):
        _, model = reference_and_model(scaled_mlps())
        policy = MixedPrecisionPolicy(
            param_dtype=BF16, param_dtype_override_fn=keep_scales_in_own_dtype(model)
        )
        shard_scaled_mlps(model, mp_policy=policy)
        observing, seen = reduce_scatter_dtypes()
        with observing:
            sum_loss(model(make_inputs(0, self.rank))).backward()
        # The two blocks mix fp32 and bf16 gradients; the root's Linear has bf16 ones.
        self.assertCountEqual(seen, [torch.float32, torch.float32, DEFAULT_REDUCE_DTYPE])


class TestDefaultReduceDtype(ReduceDtypeChecks, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_reduce_dtype_follows_the_installed_torch(self):
        self.check_reduce_dtype_follows_the_installed_torch()

    def test_mixed_gradient_dtypes_reduce_in_the_promoted_dtype(self):
        self.check_mixed_gradient_dtypes_reduce_in_the_promoted_dtype()

    def test_unset_reduce_dtype_trains_like_the_default_set_explicitly(self):
        """Bit for bit, with gradients accumulated over microbatches with sync off (kept in
        the reduce dtype in between)."""
        make_models = [lambda: MLPStack(DIM)]
        if DEFAULT_REDUCE_DTYPE == torch.float32:
            # Also groups of mixed gradient dtypes, whose promoted dtype is then the default
            # too (before 2.15 they reduce in fp32, not in the bf16 default).
            make_models.append(scaled_mlps)
        self.run_subtests({"make_model": make_models}, self._check_unset_reduce_dtype)

    def _check_unset_reduce_dtype(self, make_model):
        _, model = reference_and_model(make_model())
        explicit = copy.deepcopy(model)
        for target, reduce_dtype in ((model, None), (explicit, DEFAULT_REDUCE_DTYPE)):
            policy = MixedPrecisionPolicy(
                param_dtype=BF16,
                reduce_dtype=reduce_dtype,
                param_dtype_override_fn=keep_scales_in_own_dtype(target),
            )
            blocks = [m for m in target if isinstance(m, (MLP, ScaledMLP))]
            shard_bottom_up(target, blocks, mp_policy=policy)
        for target in (model, explicit):
            with gradient_sync_off(target):
                sum_loss(target(make_inputs(0, self.rank))).backward()
            sum_loss(target(make_inputs(1, self.rank))).backward()
        for (name, param), (_, twin) in zip(model.named_parameters(), explicit.named_parameters()):
            self.assertTrue(torch.equal(param.grad.to_local(), twin.grad.to_local()), name)

    def test_the_wrapper_api_reduces_in_param_dtype_on_every_torch(self):
        _, module = reference_and_model(MLPStack(DIM))
        model = FullyShardedDataParallel(module, mixed_precision=MixedPrecision(param_dtype=BF16))
        observing, seen = reduce_scatter_dtypes()
        with observing:
            sum_loss(model(make_inputs(0, self.rank))).backward()
        self.assertEqual(seen, [BF16])


class TestKeepUnshardedStorage(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_data_pointers_stay_and_training_is_unchanged(self):
        _, model = reference_and_model(MLPStack(DIM))
        plain = copy.deepcopy(model)
        for target in (model, plain):
            shard_bottom_up(target, target)
        model.set_keep_unsharded_storage(True)
        pointers: list[int] = []
        model[1].register_forward_pre_hook(
            lambda module, args: pointers.append(module.in_proj.weight.data_ptr())
        )
        optims = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, plain)]
        for step in range(3):
            for target, optim in zip((model, plain), optims):
                sum_loss(target(make_inputs(step, self.rank))).backward()
                optim.step()
                optim.zero_grad()
            self.assertIsInstance(model[1].in_proj.weight, DTensor)  # resharded ...
            for member in model[1]._get_fsdp_state().group.members:  # ... storage kept
                self.assertGreater(member.gathered.untyped_storage().size(), 0)
            for member in plain[1]._get_fsdp_state().group.members:
                self.assertEqual(member.gathered.untyped_storage().size(), 0)
        self.assertEqual(len(set(pointers)), 1, pointers)
        for (name, param), (_, twin) in zip(model.named_parameters(), plain.named_parameters()):
            self.assertTrue(torch.equal(param.to_local(), twin.to_local()), name)

    def test_recurse_false_sets_this_module_only(self):
        _, model = reference_and_model(nn.Sequential(MLP(DIM), nn.Linear(DIM, DIM)))
        shard_bottom_up(model, [model[0]])
        model.set_keep_unsharded_storage(True, recurse=False)
        sum_loss(model(make_inputs(0, self.rank))).backward()
        root_members = model._get_fsdp_state().group.members
        block_members = model[0]._get_fsdp_state().group.members
        self.assertTrue(all(m.gathered.untyped_storage().size() > 0 for m in root_members))
        self.assertTrue(all(m.gathered.untyped_storage().size() == 0 for m in block_members))
        with self.assertRaisesRegex(TypeError, "bool"):
            model.set_keep_unsharded_storage("yes")
