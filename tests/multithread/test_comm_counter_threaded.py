"""CommCounter over the threaded process group, which the dispatcher never sees.

The threaded group reports its collectives through ``record_collective``; each rank's
counter must see exactly its own rank's calls, once each, DTensor's included.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp.core import comms
from reffsdp.core.comms import Collective
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.patching import patch_all_gather

pytestmark = pytest.mark.multithread

FLOAT_BYTES = 4


class TestCommCounterThreaded(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_counts_bytes_and_patches(self) -> None:
        group, world = dist.group.WORLD, self.world_size
        mesh = init_device_mesh("cpu", (world,))
        sharded = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        patched = []

        def recording_all_gather(output, input, group=None, async_op=False):
            patched.append(dist.get_rank())
            return comms.torch_all_gather()(output, input, group=group, async_op=async_op)

        with CommCounter() as counter, patch_all_gather(recording_all_gather):
            dist.all_gather_single(torch.empty(3 * world), torch.ones(3))
            dist.reduce_scatter_single(torch.empty(3), torch.ones(3 * world))
            dist.all_reduce(torch.ones(3))
            dist.broadcast(torch.ones(3), src=0)
            comms.all_gather(torch.empty(3 * world), torch.ones(3), group)
            sharded.redistribute(mesh, [Replicate()]).to_local()  # a functional all-gather
        self.assertEqual(patched, [self.rank])  # each rank's patch saw only its own call
        self.assertEqual(
            counter.get_comm_counts(),
            {
                Collective.ALL_GATHER: 3,
                Collective.REDUCE_SCATTER: 1,
                Collective.ALL_REDUCE: 1,
                Collective.BROADCAST: 1,
            },
        )
        full_bytes = 3 * world * FLOAT_BYTES
        dtensor_bytes = 2 * world * 4 * FLOAT_BYTES
        self.assertEqual(
            counter.get_comm_bytes(),
            {
                Collective.ALL_GATHER: 2 * full_bytes + dtensor_bytes,
                Collective.REDUCE_SCATTER: full_bytes,
                Collective.ALL_REDUCE: 3 * FLOAT_BYTES,
                Collective.BROADCAST: 3 * FLOAT_BYTES,
            },
        )
