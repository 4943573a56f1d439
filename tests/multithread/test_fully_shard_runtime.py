"""``fully_shard`` runtime controls still train exactly like DDP.

Explicit forward and backward prefetching, explicit (async) unsharding before forward,
``register_fsdp_forward_method``, ``share_comm_ctx`` between two roots, ``reset_iter_state``
after an exception, and ``reshard()`` after an ``unshard()`` with no forward.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from reffsdp import FSDPModule, register_fsdp_forward_method, share_comm_ctx
from reffsdp.testing.build import reference_and_model, shard_bottom_up
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import Passthrough, check_train_parity
from reffsdp.testing.patching import observe_all_gathers

pytestmark = pytest.mark.multithread


make_inputs = random_inputs(2, 8)


def _shard_mlps(model: nn.Module, **kwargs) -> None:
    """``fully_shard`` every :class:`MLP` in ``model``, then ``model``, which owns the rest."""
    shard_bottom_up(model, [m for m in model.modules() if isinstance(m, MLP)], **kwargs)


def _record_all_gathers(record):
    """Call ``record()`` at each of this rank's reffsdp all-gathers."""
    return observe_all_gathers(lambda output, input, group: record())


class UnshardBeforeForward(nn.Module):
    """Unshards every FSDP module of ``module`` asynchronously, then runs its forward."""

    def __init__(self, module: nn.Module, wait: bool) -> None:
        super().__init__()
        self.module = module
        self.wait = wait
        self.forward_all_gathers: list[int] = []  # all-gathers issued inside module(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fsdp_modules = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        handles = [m.unshard(async_op=True) for m in fsdp_modules]
        if self.wait:
            for handle in handles:
                handle.wait()
        count = [0]
        with _record_all_gathers(lambda: count.__setitem__(0, count[0] + 1)):
            out = self.module(x)
        self.forward_all_gathers.append(count[0])
        return out


class Decoder(nn.Module):
    """``forward`` runs the trunk once; ``generate`` runs it twice without calling forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([MLP(dim), MLP(dim)])
        self.head = nn.Linear(dim, dim)

    def _trunk(self, h: torch.Tensor) -> torch.Tensor:
        h = self.embed(h)
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._trunk(x))

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._trunk(self._trunk(x)))


class CallGenerate(nn.Module):
    def __init__(self, module: Decoder) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.generate(x)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise FlakyError("backward")


class FlakyError(Exception):
    pass


class FlakyMLP(MLP):
    """An :class:`MLP` that raises in its forward or backward while ``fail_in`` says so."""

    fail_in: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_in == "forward":
            raise FlakyError("forward")
        out = super().forward(x)
        return _RaiseInBackward.apply(out) if self.fail_in == "backward" else out


class TestFullyShardRuntime(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_explicit_prefetching(self):
        ref_model, model = reference_and_model(MLPStack(8))
        _shard_mlps(model)
        blocks = list(model)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0) : i])
        forwards_started = [0]
        for block in blocks:  # runs after FSDP's own pre-forward (which is prepended)
            block.register_forward_pre_hook(
                lambda *_: forwards_started.__setitem__(0, forwards_started[0] + 1)
            )
        with torch.no_grad():
            at_all_gather = []
            with _record_all_gathers(lambda: at_all_gather.append(forwards_started[0])):
                model(make_inputs(0, self.rank))
        # Block 0's pre-forward also gathers block 1, and block 1's gathers block 2: each
        # block's all-gather is issued while the block before it is about to run.
        self.assertEqual(at_all_gather, [0, 0, 1])

        num_steps = 2
        all_gathers = []
        with _record_all_gathers(lambda: all_gathers.append(1)):
            check_train_parity(self, ref_model, model, make_inputs, num_steps=num_steps)
        self.assertEqual(len(all_gathers), num_steps * 3 * 2)  # each block: forward, backward

    def test_unshard_before_forward(self):
        self.run_subtests({"wait": [True, False]}, self._test_unshard_before_forward)

    def _test_unshard_before_forward(self, wait: bool):
        ref_model, model = reference_and_model(nn.Sequential(MLP(8), MLP(8), nn.Linear(8, 8)))
        _shard_mlps(model, reshard_after_forward=True)
        wrapped = UnshardBeforeForward(model, wait)
        check_train_parity(self, Passthrough(ref_model), wrapped, make_inputs, num_steps=3)
        # The explicit unshard did every forward all-gather; forward only waited for them.
        self.assertEqual(wrapped.forward_all_gathers, [0, 0, 0])

    def test_register_fsdp_forward_method(self):
        ref_model, model = reference_and_model(Decoder(8))
        shard_bottom_up(model, model.blocks)
        register_fsdp_forward_method(model, "generate")
        check_train_parity(self, CallGenerate(ref_model), CallGenerate(model), make_inputs)

    def test_generate_without_registering_fails(self):
        _, model = reference_and_model(Decoder(8))
        shard_bottom_up(model, model.blocks)
        # The root's own parameters (embed, head) are only gathered around forward.
        with self.assertRaisesRegex(RuntimeError, "mixed torch.Tensor and DTensor"):
            model.generate(make_inputs(0, self.rank))

    def test_share_comm_ctx_between_roots(self):
        stages = nn.Sequential(nn.Sequential(MLP(8), MLP(8)), nn.Sequential(MLP(8), MLP(8)))
        ref_model, model = reference_and_model(stages)
        for stage in model:  # two roots, e.g. two pipeline stages on these ranks
            _shard_mlps(stage)
        share_comm_ctx(list(model))
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)

    def test_reset_iter_state_after_exception(self):
        self.run_subtests(
            {"fail_in": ["forward", "backward"], "reshard_after_forward": [True, False]},
            self._test_reset_iter_state_after_exception,
        )

    def _test_reset_iter_state_after_exception(self, fail_in: str, reshard_after_forward: bool):
        model = nn.Sequential(MLP(8), FlakyMLP(8), MLP(8), nn.Linear(8, 8))
        ref_model, model = reference_and_model(model)
        _shard_mlps(model, reshard_after_forward=reshard_after_forward)
        model[1].fail_in = fail_in
        with self.assertRaisesRegex(FlakyError, fail_in):
            model(make_inputs(0, self.rank)).sum().backward()
        model[1].fail_in = None
        with self.assertRaisesRegex(RuntimeError, "root"):
            model[1].reset_iter_state()
        model.reset_iter_state()
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
        # Reductions that finished before the failure wrote their gradients (as in torch);
        # the next step starts from zeroed gradients, like the reference's.
        model.zero_grad(set_to_none=True)
        # Training continues as if the failed iteration never happened.
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)

    def test_reshard_after_unshard_without_forward(self):
        ref_model, model = reference_and_model(nn.Sequential(MLP(8), nn.Linear(8, 8)))
        _shard_mlps(model)
        model.unshard()
        for name, ref_param in ref_model[1].named_parameters():
            param = model[1].get_parameter(name)  # the root's own parameters: unsharded
            self.assertNotIsInstance(param, DTensor, name)
            torch.testing.assert_close(param, ref_param, rtol=0, atol=0)
        self.assertIsInstance(model[0].in_proj.weight, DTensor)  # unshard() is not recursive
        model.reshard()
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
        check_train_parity(self, ref_model, model, make_inputs, num_steps=3)


class TestFullyShardRuntimeWorldSize4(TestFullyShardRuntime):
    @property
    def world_size(self) -> int:
        return 4
