"""``FullyShardedDataParallel`` state dicts of tied weights, shared modules and
activation-checkpointed models next to torch's wrapper, in real gloo processes.

Here a value that views freed memory crashes only its rank process, which the harness
reports as a failure (the threaded tests check that no value views such memory before
reading any). Names and types are compared with torch's wrapper on the same model; values
with the unwrapped model (torch's own values under a shared module's second name view
freed memory, so they are not read).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import StateDictType as TorchStateDictType

from reffsdp import FullyShardedDataParallel as FSDP
from reffsdp.api import StateDictType
from reffsdp.testing.models import MLPBlocks
from reffsdp.testing.multiprocess import FSDPTest
from tests.multithread.test_wrapper_state_dict import DIM, torch_wrap, wrap
from tests.multithread.test_wrapper_state_dict_models import (
    SharedModuleAndParameter,
    _local_values,
    tied_stack,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.filterwarnings("ignore::FutureWarning")]

TYPES = list(zip(StateDictType, TorchStateDictType))


class TestWrapperStateDictGloo(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_shared_parameters_next_to_torch(self):
        """Tied weights (a GPT-2's embedding and output layer), a shared module and a
        parameter registered twice: each state-dict type has torch's names and types,
        values that can be read, cloned and saved after ``state_dict()`` returned, and
        loads back where torch's does (a SHARDED load of a tied weight raised)."""
        for factory in (tied_stack, SharedModuleAndParameter):
            for use_orig_params in (False, True):
                torch.manual_seed(0)
                base = factory()
                ours = wrap(copy.deepcopy(base), use_orig_params=use_orig_params)
                theirs = torch_wrap(base, use_orig_params=use_orig_params)
                for kind, torch_kind in TYPES:
                    where = f"{factory.__name__}, {kind}, use_orig_params={use_orig_params}"
                    with TorchFSDP.state_dict_type(theirs, torch_kind):
                        expected = theirs.state_dict()
                    with FSDP.state_dict_type(ours, kind):
                        state = ours.state_dict()
                    self.assertEqual(list(state), list(expected), where)
                    for name, value in expected.items():
                        if type(value) is not torch.Tensor:  # torch's shared-module values
                            self.assertIs(type(state[name]), type(value), f"{where}: {name}")
                    self._check_readable(state, base, kind, where)
                    with FSDP.state_dict_type(ours, kind):
                        ours.load_state_dict(state)

    def _check_readable(self, state: dict, base: nn.Module, kind, where: str) -> None:
        torch.save(state, io.BytesIO())
        if kind is StateDictType.LOCAL_STATE_DICT:
            return
        reference = base.state_dict()
        for name, value in state.items():
            local = _local_values(value)[0].clone()
            expected = reference[name]
            if type(value) is not torch.Tensor:
                expected = expected.chunk(self.world_size)[self.rank]
            self.assertTrue(torch.equal(local, expected), f"{where}: {name}")

    def test_checkpoint_wrappers_next_to_torch(self):
        """``FSDP(checkpoint_wrapper(block))`` per block: torch's names (the unwrapped
        model's for FULL and SHARDED) for every state-dict type, and each loads into the
        same model without checkpoint wrappers and back (a KeyError before)."""
        for use_orig_params in (False, True):
            torch.manual_seed(0)
            base = MLPBlocks(DIM, (3, 4), with_buffer=True)
            ours = _checkpointed(base, FSDP, use_orig_params=use_orig_params)
            theirs = _checkpointed(
                base, TorchFSDP, use_orig_params=use_orig_params, device_id=torch.device("cpu")
            )
            plain = wrap(MLPBlocks(DIM, (3, 4), with_buffer=True), use_orig_params=use_orig_params)
            for kind, torch_kind in TYPES:
                where = f"{kind}, use_orig_params={use_orig_params}"
                with TorchFSDP.state_dict_type(theirs, torch_kind):
                    expected = theirs.state_dict()
                    if kind is not StateDictType.LOCAL_STATE_DICT or not use_orig_params:
                        theirs.load_state_dict(expected)  # torch loads no such local one
                with FSDP.state_dict_type(ours, kind), FSDP.state_dict_type(plain, kind):
                    state = ours.state_dict()
                    self.assertEqual(list(state), list(expected), where)
                    self._check_readable(state, base, kind, where)
                    plain.load_state_dict(state)
                    ours.load_state_dict(plain.state_dict())
                with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
                    for name, value in ours.state_dict().items():
                        self.assertTrue(torch.equal(value, base.state_dict()[name]), name)


def _checkpointed(base: MLPBlocks, wrapper_cls, **kwargs) -> nn.Module:
    """``wrapper_cls(checkpoint_wrapper(block))`` for each block of a copy of ``base``, then
    ``wrapper_cls`` at the root."""
    model = copy.deepcopy(base)
    for i, layer in enumerate(model.layers):
        model.layers[i] = wrapper_cls(checkpoint_wrapper(layer), **kwargs)
    return wrapper_cls(model, **kwargs)
