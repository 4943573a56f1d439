"""CommCounter and the patch helpers on each harness's process group.

The threaded group reports its collectives through ``record_collective``, which the
dispatcher never sees; gloo (``tests/multiprocess/test_comm_counter_gloo.py``) goes through
the dispatcher. Either way each rank's counter must see exactly its own rank's calls, once
each, DTensor's included. One test method holds several checks: each multi-process test pays
for starting its ranks.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp.core import comms, compat
from reffsdp.core.comms import Collective
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.multithread import FSDPTestMultiThread
from reffsdp.testing.patching import observe_all_gathers, patch_all_gather, patch_reduce_scatter

pytestmark = pytest.mark.multithread

FLOAT_BYTES = 4


class CommCounterTests:
    # torch 2.13 deprecates all_gather_into_tensor. A mark, not warnings.catch_warnings in
    # the body: threaded ranks share the process's warning filters, which catch_warnings
    # would save and restore out of order. (Gloo ranks print the warning to captured stderr.)
    @pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*:FutureWarning")
    def test_counts_bytes_and_patches(self) -> None:
        self._check_torch_distributed_calls()
        self._check_dtensor_redistribution()
        self._check_patches_on_reffsdp_comms()
        self._check_one_counter_per_rank()

    def _check_torch_distributed_calls(self) -> None:
        world, rank, device = self.world_size, self.rank, self.device
        shard = torch.full((3,), float(rank), device=device)
        full = torch.empty(3 * world, device=device)
        expected_full = torch.arange(world, device=device).float().repeat_interleave(3)
        with CommCounter() as counter:
            compat.all_gather_single()(full, shard)
            torch.testing.assert_close(full, expected_full)
            dist.all_gather_into_tensor(full, shard)
            gathered = [torch.empty(3, device=device) for _ in range(world)]
            dist.all_gather(gathered, shard)
            reduced = torch.empty(3, device=device)
            compat.reduce_scatter_single()(reduced, torch.ones(3 * world, device=device))
            torch.testing.assert_close(reduced, torch.full((3,), float(world), device=device))
            dist.all_reduce(shard)
            dist.broadcast(shard, src=0)
        full_bytes = 3 * world * FLOAT_BYTES
        self._check_one_of_each(counter, all_gather_bytes=3 * full_bytes)

    def _check_dtensor_redistribution(self) -> None:
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        local = torch.full((2, 4), float(self.rank), device=self.device)
        sharded = DTensor.from_local(local, mesh, [Shard(0)])
        with CommCounter() as counter:
            replicated = sharded.redistribute(mesh, [Replicate()]).to_local()
        self.assertEqual(replicated[:, 0].tolist(), self._each_rank_twice())
        self.assertEqual(counter.get_comm_counts(), {Collective.ALL_GATHER: 1})

    def _check_patches_on_reffsdp_comms(self) -> None:
        group, device = dist.group.WORLD, self.device
        seen = []

        def inspecting_all_gather(output, input, group=None, async_op=False):
            seen.append(input.clone())
            return compat.all_gather_single()(output, input, group=group, async_op=async_op)

        def halving_reduce_scatter(output, input, op=None, group=None, async_op=False):
            work = compat.reduce_scatter_single()(output, input, op=op, group=group)
            output.div_(2)
            return work

        output = torch.empty(2 * self.world_size, device=device)
        reduced = torch.empty(2, device=device)
        with (
            patch_all_gather(inspecting_all_gather),
            patch_reduce_scatter(halving_reduce_scatter),
            CommCounter() as counter,
        ):
            comms.all_gather(output, torch.full((2,), float(self.rank), device=device), group)
            comms.reduce_scatter(reduced, torch.ones(2 * self.world_size, device=device), group)
        self.assertEqual([tensor.tolist() for tensor in seen], [[float(self.rank)] * 2])
        self.assertEqual(output.tolist(), self._each_rank_twice())
        self.assertEqual(reduced.tolist(), [self.world_size / 2] * 2)
        self.assertEqual(
            counter.get_comm_counts(), {Collective.ALL_GATHER: 1, Collective.REDUCE_SCATTER: 1}
        )

    def _check_one_counter_per_rank(self) -> None:
        """One counter over plain, reffsdp and DTensor collectives, and a patch, per rank."""
        group, world, device = dist.group.WORLD, self.world_size, self.device
        mesh = init_device_mesh(device.type, (world,))
        sharded = DTensor.from_local(torch.ones(2, 4, device=device), mesh, [Shard(0)])
        patched = []
        with (
            CommCounter() as counter,
            observe_all_gathers(lambda output, input, group: patched.append(dist.get_rank())),
        ):
            compat.all_gather_single()(
                torch.empty(3 * world, device=device), torch.ones(3, device=device)
            )
            compat.reduce_scatter_single()(
                torch.empty(3, device=device), torch.ones(3 * world, device=device)
            )
            dist.all_reduce(torch.ones(3, device=device))
            dist.broadcast(torch.ones(3, device=device), src=0)
            comms.all_gather(
                torch.empty(3 * world, device=device), torch.ones(3, device=device), group
            )
            sharded.redistribute(mesh, [Replicate()]).to_local()  # a functional all-gather
        self.assertEqual(patched, [self.rank])  # each rank's patch saw only its own call
        dtensor_bytes = 2 * world * 4 * FLOAT_BYTES
        self._check_one_of_each(
            counter, all_gather_bytes=2 * 3 * world * FLOAT_BYTES + dtensor_bytes
        )

    def _check_one_of_each(self, counter: CommCounter, all_gather_bytes: int) -> None:
        """Three all-gathers and one each of the rest, on 3-element shards of floats."""
        full_bytes = 3 * self.world_size * FLOAT_BYTES
        self.assertEqual(
            counter.get_comm_counts(),
            {
                Collective.ALL_GATHER: 3,
                Collective.REDUCE_SCATTER: 1,
                Collective.ALL_REDUCE: 1,
                Collective.BROADCAST: 1,
            },
        )
        self.assertEqual(
            counter.get_comm_bytes(),
            {
                Collective.ALL_GATHER: all_gather_bytes,
                Collective.REDUCE_SCATTER: full_bytes,
                Collective.ALL_REDUCE: 3 * FLOAT_BYTES,
                Collective.BROADCAST: 3 * FLOAT_BYTES,
            },
        )

    def _each_rank_twice(self) -> list[float]:
        return [float(rank) for rank in range(self.world_size) for _ in range(2)]


class TestCommCounterThreaded(CommCounterTests, FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2
