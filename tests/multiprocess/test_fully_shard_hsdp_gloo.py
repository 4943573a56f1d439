"""HSDP over real gloo processes: a 2x2 ``(dp_replicate, dp_shard)`` mesh trains like DDP.

The threaded twin (``tests/multithread/test_fully_shard_hsdp.py``) covers more knobs; this
file repeats the core where the collectives run on a real backend, one process per rank.
"""

from __future__ import annotations

import copy

import pytest
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from reffsdp import fully_shard
from reffsdp.core.comms import Collective
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.inputs import random_inputs
from reffsdp.testing.meshes import mesh_hsdp
from reffsdp.testing.models import MLPBlocks
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.parity import (
    all_reduce_off,
    broadcast_params_from_rank0,
    check_train_parity,
    gradient_sync_off,
)

pytestmark = pytest.mark.multiprocess

AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE
DIM = 8
NUM_BLOCKS = 2


make_inputs = random_inputs(2, DIM)


class TestHSDPOverGloo(FSDPTest):
    @property
    def world_size(self) -> int:
        return 4

    def _ref_and_model(self, **fsdp_kwargs) -> tuple[nn.Module, MLPBlocks]:
        model = MLPBlocks(DIM, (3, 4))
        broadcast_params_from_rank0(model)
        ref = copy.deepcopy(model)
        mesh = mesh_hsdp(2, 2)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **fsdp_kwargs)
        fully_shard(model, mesh=mesh, **fsdp_kwargs)
        return ref, model

    def test_train_parity(self):
        self.run_subtests({"reshard_after_forward": [True, False]}, self._check_parity)

    def _check_parity(self, reshard_after_forward):
        ref, model = self._ref_and_model(reshard_after_forward=reshard_after_forward)
        for name, param in model.named_parameters():
            self.assertEqual(param.placements, (Replicate(), Shard(0)), name)
        groups = NUM_BLOCKS + 1
        with CommCounter() as counter:
            model(make_inputs(0, self.rank)).sum().backward()
        backward_gathers = groups if reshard_after_forward else 0
        self.assertEqual(
            counter.get_comm_counts(), {AG: groups + backward_gathers, RS: groups, AR: groups}
        )
        self.assertEqual(counter.get_comm_bytes()[RS], 2 * counter.get_comm_bytes()[AR])
        model.zero_grad()
        check_train_parity(self, ref, model, make_inputs, num_steps=2)

    def test_gradient_accumulation(self):
        self.run_subtests(
            {"no_sync": [all_reduce_off, gradient_sync_off]}, self._check_accumulation
        )

    def _check_accumulation(self, no_sync):
        ref, model = self._ref_and_model()
        groups = NUM_BLOCKS + 1
        with no_sync(model), CommCounter() as counter:
            model(make_inputs(0, self.rank)).sum().backward()
        expected_rs = groups if no_sync is all_reduce_off else 0
        self.assertEqual(counter.get_comm_counts()[RS], expected_rs)
        self.assertEqual(counter.get_comm_counts()[AR], 0)
        model.zero_grad()
        ref2, model2 = self._ref_and_model()
        check_train_parity(
            self, ref2, model2, make_inputs, num_steps=2, num_microbatches=2, no_sync=no_sync
        )
