"""The fake process group: big worlds in one process, meshes, shape-correct collectives."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from reffsdp.core import comms
from reffsdp.testing import torch_private
from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.testing.multiprocess import FSDPTest


@pytest.mark.parametrize("world_size, rank", [(64, 0), (64, 63), (1024, 700)])
def test_group_is_rank_of_world(world_size: int, rank: int) -> None:
    with fake_process_group(world_size, rank) as group:
        assert dist.get_backend() == "fake"
        assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
        assert group.size() == world_size
    assert not dist.is_initialized()


def test_meshes() -> None:
    with fake_process_group(1024, 700):
        mesh = init_device_mesh("cpu", (8, 128), mesh_dim_names=("dp", "shard"))
        assert list(mesh.get_coordinate()) == [5, 60]  # 700 = 5 * 128 + 60
        shard_group = mesh["shard"].get_group()
        assert (shard_group.size(), dist.get_rank(shard_group)) == (128, 60)
        assert mesh["dp"].size() == 8
    with fake_process_group(64, 9):  # a second group in the same process works too
        mesh = init_device_mesh("cpu", (2, 4, 8))
        assert list(mesh.get_coordinate()) == [0, 1, 1]


def test_collectives_have_real_shapes_and_fake_numbers() -> None:
    world_size, rank = 64, 5
    with fake_process_group(world_size, rank) as group:
        shard = torch.arange(4.0)
        gathered = torch.empty(world_size * 4)
        comms.all_gather(gathered, shard, group)
        # every slot holds the local input: see [Note: fake collectives]
        assert torch.equal(gathered, shard.repeat(world_size))

        full = torch.arange(world_size * 4.0)
        reduced = torch.full((4,), -1.0)
        comms.reduce_scatter(reduced, full, group)
        if torch_private.FAKE_REDUCE_SCATTER_WRITES_OUTPUT:
            assert torch.equal(reduced, full[rank * 4 : (rank + 1) * 4])  # no reduction
        else:
            assert torch.equal(reduced, torch.full((4,), -1.0))  # left as it was

        tensor = torch.ones(3)
        comms.all_reduce(tensor, group)
        comms.broadcast(tensor, 0, group)
        assert torch.equal(tensor, torch.ones(3))

        work = comms.all_gather(gathered, shard, group, async_op=True)
        assert work is not None and work.wait()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rank must be in"):
        with fake_process_group(8, 8):
            pass
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        with fake_process_group(0):
            pass
    with fake_process_group(8):
        with pytest.raises(RuntimeError, match="already initialized"):
            with fake_process_group(8):
                pass


class TestFakeClass(FSDPTest):
    """``fake_pg = True`` runs every method in this process as ``fake_rank`` of the world."""

    fake_pg = True
    fake_rank = 37

    @property
    def world_size(self) -> int:
        return 64

    def setUp(self) -> None:
        super().setUp()
        self.rank_in_set_up = self.rank  # the group exists before setUp runs

    def test_rank_world_size_and_subtests(self) -> None:
        self.assertEqual((self.rank, self.rank_in_set_up), (37, 37))
        self.assertEqual(dist.get_world_size(), 64)
        self.assertEqual(self.device, torch.device("cpu"))
        seen = []
        self.run_subtests({"x": [1, 2]}, lambda x: seen.append(x))
        self.assertEqual(seen, [1, 2])
