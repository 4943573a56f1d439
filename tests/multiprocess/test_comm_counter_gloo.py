"""CommCounter and the patch helpers over real gloo processes (NCCL with ``--device cuda``).

One test method holds several checks: each multi-process test pays for starting its ranks.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from reffsdp.core import comms
from reffsdp.core.comms import Collective
from reffsdp.testing.comm_counter import CommCounter
from reffsdp.testing.multiprocess import FSDPTest
from reffsdp.testing.patching import patch_all_gather, patch_reduce_scatter

pytestmark = pytest.mark.multiprocess

FLOAT_BYTES = 4


class TestCommCounterGloo(FSDPTest):
    def test_counts_bytes_and_patches(self) -> None:
        self._check_torch_distributed_calls()
        self._check_dtensor_redistribution()
        self._check_patches_on_reffsdp_comms()

    def _check_torch_distributed_calls(self) -> None:
        world, rank, device = self.world_size, self.rank, self.device
        shard = torch.full((3,), float(rank), device=device)
        full = torch.empty(3 * world, device=device)
        expected_full = torch.arange(world, device=device).float().repeat_interleave(3)
        with CommCounter() as counter:
            dist.all_gather_single(full, shard)
            torch.testing.assert_close(full, expected_full)
            with warnings.catch_warnings():  # the pre-2.13 name warns on torch 2.13
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(full, shard)
            gathered = [torch.empty(3, device=device) for _ in range(world)]
            dist.all_gather(gathered, shard)
            reduced = torch.empty(3, device=device)
            dist.reduce_scatter_single(reduced, torch.ones(3 * world, device=device))
            torch.testing.assert_close(reduced, torch.full((3,), float(world), device=device))
            dist.all_reduce(shard)
            dist.broadcast(shard, src=0)
        full_bytes = 3 * world * FLOAT_BYTES
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
                Collective.ALL_GATHER: 3 * full_bytes,
                Collective.REDUCE_SCATTER: full_bytes,
                Collective.ALL_REDUCE: 3 * FLOAT_BYTES,
                Collective.BROADCAST: 3 * FLOAT_BYTES,
            },
        )

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
            return comms.torch_all_gather()(output, input, group=group, async_op=async_op)

        def halving_reduce_scatter(output, input, op=None, group=None, async_op=False):
            work = comms.torch_reduce_scatter()(output, input, op=op, group=group)
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

    def _each_rank_twice(self) -> list[float]:
        return [float(rank) for rank in range(self.world_size) for _ in range(2)]
