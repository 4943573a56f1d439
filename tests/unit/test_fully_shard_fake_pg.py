"""Sharded layouts at big world sizes, one process, on the fake process group."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from reffsdp import fully_shard
from reffsdp.testing.fake_pg import fake_process_group


@pytest.mark.parametrize("world_size", [64, 1024])
@pytest.mark.parametrize("rank_choice", ["first", "middle", "last"])
def test_layout_at_scale(world_size, rank_choice):
    rank = {"first": 0, "middle": world_size // 2 + 1, "last": world_size - 1}[rank_choice]
    with fake_process_group(world_size, rank):
        mesh = init_device_mesh("cpu", (world_size,))
        sizes = [(100, 7), (world_size + 3, 2), (5,), (3 * world_size,)]
        model = nn.ParameterList([nn.Parameter(torch.randn(s)) for s in sizes])
        container = nn.Module()
        container.params = model
        fully_shard(container, mesh=mesh)
        for param, size in zip(container.parameters(), sizes):
            assert isinstance(param, DTensor)
            assert param.placements == (Shard(0),)
            assert param.size() == size
            chunk = -(-size[0] // world_size)
            start = min(rank * chunk, size[0])
            rows = min(start + chunk, size[0]) - start
            assert param.to_local().size() == (rows, *size[1:])
            assert param.to_local().is_contiguous()


def test_hsdp_layout_at_scale():
    with fake_process_group(1024, 700):
        mesh = init_device_mesh("cpu", (8, 128), mesh_dim_names=("replicate", "shard"))
        lin = nn.Linear(300, 200)
        fully_shard(lin, mesh=mesh)
        weight = lin.weight
        assert weight.placements[1] == Shard(0)
        shard_rank = 700 % 128
        chunk = -(-200 // 128)
        rows = max(0, min(chunk, 200 - shard_rank * chunk))
        assert weight.to_local().size() == (rows, 300)


def test_unshard_at_scale_gives_full_shapes():
    with fake_process_group(256, 3):
        mesh = init_device_mesh("cpu", (256,))
        model = nn.Sequential(nn.Linear(16, 600), nn.Linear(600, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out = model(torch.randn(2, 16))
        assert out.shape == (2, 4)
        out.sum().backward()
        for param in model.parameters():
            assert isinstance(param.grad, DTensor)
            assert param.grad.to_local().shape == param.to_local().shape
