"""``check_train_parity`` on torch's ``FullyShardedDataParallel``, read through its public API.

Names, full parameters and gradients come from torch's own ``summon_full_params``, with flat
parameters or ``use_orig_params=True`` (see [Note: another implementation's wrapper] in
``testing/parity.py``); before, the check stopped at the names
(``'_fsdp_wrapped_module.0._fsdp_wrapped_module._flat_param' vs '0.in_proj.weight'``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

from reffsdp.core import compat
from reffsdp.testing import build_seeded
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.models import MLP, MLPStack
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.parity import check_train_parity

pytestmark = pytest.mark.multithread

DIM = 16


def _reference_and_torch_wrapped(
    use_orig_params: bool, frozen: bool = False
) -> tuple[nn.Module, TorchFSDP]:
    """An MLP stack and its copy under torch's wrapper, an instance per MLP and the root."""
    model = build_seeded(lambda: MLPStack(DIM), seed=0)  # the same weights on every rank
    if frozen:  # an instance with no gradient: None on both sides
        model[1].requires_grad_(False)
    ref_model = copy.deepcopy(model)
    wrapped = TorchFSDP(
        model,
        auto_wrap_policy=TorchPolicy({MLP}),
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
    )
    return ref_model, wrapped


class TestTorchWrapperParity(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_torchs_wrapper_passes_with_flat_and_original_parameters(self):
        self.run_subtests(
            {"use_orig_params": [False, True], "frozen": [False, True]},
            self._check_torchs_wrapper,
        )

    def _check_torchs_wrapper(self, use_orig_params: bool, frozen: bool) -> None:
        ref_model, model = _reference_and_torch_wrapped(use_orig_params, frozen)
        shards = {name: p.detach().clone() for name, p in model.named_parameters()}
        result = check_train_parity(self, ref_model, model, random_inputs(4, DIM), num_steps=1)
        self.assertEqual(len(result), 1)
        # The flat gradients were summoned in the shards' place (the weights checked after
        # the optimizer step show they were put back); the shards are the trained ones,
        # changed but for the frozen instance's.
        for name, param in model.named_parameters():
            self.assertEqual(param.shape, shards[name].shape)
            if param.numel():
                changed = not torch.equal(param, shards[name])
                self.assertEqual(changed, param.requires_grad, name)

    def test_torchs_wrapper_gradients_are_compared(self):
        """A communication hook that sums without dividing (a wrong divide factor) fails
        the gradients, flat or original, at step 0."""
        self.run_subtests({"use_orig_params": [False, True]}, self._check_wrong_divide_factor)

    def _check_wrong_divide_factor(self, use_orig_params: bool) -> None:
        ref_model, model = _reference_and_torch_wrapped(use_orig_params)

        def sum_without_divide(group: dist.ProcessGroup, grad: torch.Tensor, output=None):
            compat.reduce_scatter_single()(output, grad, group=group)

        model.register_comm_hook(dist.group.WORLD, sum_without_divide)
        with self.assertRaisesRegex(AssertionError, r"step 0 after backward(.|\n)*grad of"):
            check_train_parity(None, ref_model, model, random_inputs(4, DIM))
