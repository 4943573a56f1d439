"""reffsdp's testing package: harnesses, process groups, comm counting, parity checks, models.

Downstream projects import it as ``reffsdp.testing``::

    from reffsdp.testing import FSDPTest, FSDPTestMultiThread, check_sharded_parity
    from reffsdp.testing import check_train_parity, expected_counts, parity_scenarios

``python -m reffsdp.testing`` runs the parity suite (sharded training against DDP).
``simulated_streams()`` runs CPU work on logical CUDA streams (see ``logical_streams``).
"""

from reffsdp.core.comms import Collective

from .build import build_seeded, fsdp_modules, reference_and_model, shard_bottom_up
from .comm_counter import CommCounter, all_gather_numel
from .common import DistributedTestMixin
from .expected_comms import expected_counts
from .fake_pg import FakeStore, fake_process_group
from .inputs import random_inputs, random_tokens
from .logical_streams import simulated_streams
from .meshes import mesh_1d, mesh_dp_tp, mesh_hsdp, mesh_nd
from .models import (
    MLP,
    ConvNet,
    DoubleLinear,
    MLPBlocks,
    MLPStack,
    ModelArgs,
    Transformer,
    init_deterministic,
)
from .multiprocess import FSDPTest
from .multithread import FSDPTestMultiThread, run_threaded
from .parity import (
    LowPrecisionCompute,
    ParityDiffs,
    Passthrough,
    TrainParity,
    all_reduce_off,
    broadcast_params_from_rank0,
    check_sharded_parity,
    check_state_dict_parity,
    check_train_parity,
    gradient_sync_off,
    sgd_with_momentum,
    sum_loss,
)
from .parity_suite import ParityScenario, parity_scenarios
from .patching import (
    count_all_gathers,
    observe_all_gathers,
    observe_collectives,
    observe_reduce_scatters,
    patch_all_gather,
    patch_all_reduce,
    patch_broadcast,
    patch_reduce_scatter,
)
from .tolerances import Tolerance, default_tolerance

__all__ = [
    "MLP",
    "LowPrecisionCompute",
    "ParityDiffs",
    "ParityScenario",
    "Passthrough",
    "Tolerance",
    "TrainParity",
    "Collective",
    "CommCounter",
    "ConvNet",
    "DistributedTestMixin",
    "DoubleLinear",
    "FSDPTest",
    "FSDPTestMultiThread",
    "FakeStore",
    "MLPBlocks",
    "MLPStack",
    "ModelArgs",
    "Transformer",
    "all_gather_numel",
    "all_reduce_off",
    "broadcast_params_from_rank0",
    "build_seeded",
    "check_sharded_parity",
    "check_state_dict_parity",
    "check_train_parity",
    "count_all_gathers",
    "default_tolerance",
    "expected_counts",
    "fake_process_group",
    "fsdp_modules",
    "gradient_sync_off",
    "init_deterministic",
    "mesh_1d",
    "mesh_dp_tp",
    "mesh_hsdp",
    "mesh_nd",
    "parity_scenarios",
    "observe_all_gathers",
    "observe_collectives",
    "observe_reduce_scatters",
    "patch_all_gather",
    "patch_all_reduce",
    "patch_broadcast",
    "patch_reduce_scatter",
    "random_inputs",
    "random_tokens",
    "reference_and_model",
    "run_threaded",
    "sgd_with_momentum",
    "shard_bottom_up",
    "simulated_streams",
    "sum_loss",
]
