"""The wrapper API trains like DDP over real gloo processes.

The threaded tests (``tests/multithread/test_wrapper_training.py``) cover every strategy,
precision and feature; this file runs a few of their bodies where collectives run on gloo,
which has no ``PREMUL_SUM`` and runs collectives on its own threads: one parity case per
strategy family and ``no_sync``. Each method runs several bodies, since every test spawns
its rank processes.
"""

import pytest
from torch.distributed.device_mesh import init_device_mesh

from reffsdp import ShardingStrategy
from reffsdp.testing.multiprocess import FSDPTest
from tests.multithread.test_wrapper_training import BF16, FP32, WrapperTrainChecks

pytestmark = pytest.mark.multiprocess

S = ShardingStrategy


class TestWrapperGloo(WrapperTrainChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_train_parity_and_no_sync(self):
        self.check_parity(S.FULL_SHARD, FP32, use_orig_params=False)
        self.check_parity(S.SHARD_GRAD_OP, BF16, use_orig_params=True)
        self.check_parity(S.NO_SHARD, FP32, use_orig_params=False)
        self.check_no_sync(S.FULL_SHARD, use_orig_params=True)
        self.check_no_sync(S.SHARD_GRAD_OP, use_orig_params=False)


class TestWrapperHybridGloo(WrapperTrainChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 4

    def test_hybrid_train_parity(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        self.check_parity(S.HYBRID_SHARD, FP32, False, mesh_kwargs={"device_mesh": mesh})
        pair = (mesh.get_group("shard"), mesh.get_group("replicate"))
        self.check_parity(S._HYBRID_SHARD_ZERO2, FP32, True, mesh_kwargs={"process_group": pair})
