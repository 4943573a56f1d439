"""``fully_shard`` trains like DDP over real gloo processes.

The threaded tests (``tests/multithread/test_fully_shard_*.py``) cover every feature; this
file runs their main test bodies where collectives run on gloo, which unlike the threaded
group has no ``PREMUL_SUM`` (custom divide factors fall back to a sum and a division) and runs
collectives on its own threads. Each method runs several bodies, since every test spawns
its rank processes.
"""

import pytest
import torch

from reffsdp.testing.multiprocess import FSDPTest
from tests.multithread.test_fully_shard_gradients import GradientChecks
from tests.multithread.test_fully_shard_mixed_precision import MixedPrecisionChecks
from tests.multithread.test_fully_shard_state_dict import StateDictChecks
from tests.multithread.test_fully_shard_training import TrainParityChecks

pytestmark = pytest.mark.multiprocess


class TestFullyShardGlooTraining(TrainParityChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 4  # ranks that own no rows, and reshard_after_forward=2

    def test_train_parity(self):
        self.check_reshard_after_forward(2)
        self.check_uneven_sizes(5, reshard_after_forward=False)  # 15- and 5-row weights
        self.check_shard_placement_fn_dim_1()
        self.check_transformer(weight_tying=True, checkpoint_activations=True)


class TestFullyShardGloo(GradientChecks, MixedPrecisionChecks, StateDictChecks, FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_gradient_reduction(self):
        self.check_gradient_divide_factor(float(self.world_size))
        self.check_gradient_divide_factor(3.0)  # gloo has no PREMUL_SUM: sum, then divide
        self.check_force_sum_reduction_for_comms()
        self.check_all_reduce_hook()
        self.check_reduce_scatter_unused_params_used_on_some_ranks()
        self.check_mixed_precision_parity(torch.bfloat16, output_dtype=None)

    def test_accumulation_and_state_dict(self):
        self.check_accumulate_without_sync(reshard_after_backward=False)
        self.check_accumulate_with_gradient_sync()
        self.check_load_state_dict_of_shards(meta_init=False)
        self.check_load_state_dict_of_shards(meta_init=True)
