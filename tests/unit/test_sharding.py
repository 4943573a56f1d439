"""Exhaustive checks of the pure sharding math against torch.chunk, in one process."""

import itertools

import pytest
import torch

from reffsdp.core.sharding import (
    ShardLayout,
    chunk_rows,
    contiguous_strides,
    pre_post_divide_factors,
    rank_rows,
    shard_tensor,
    unshard_from_gathered,
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8, 64, 1024])
def test_rank_rows_match_torch_chunk(world_size):
    for dim_size in itertools.chain(range(0, 20), [63, 64, 65, 1000, 1025]):
        chunks = torch.arange(dim_size).chunk(world_size) if dim_size else ()
        expected = [c.numel() for c in chunks] + [0] * (world_size - len(chunks))
        got = [rank_rows(dim_size, world_size, r)[1] for r in range(world_size)]
        assert got == expected, (dim_size, world_size)
        starts = [rank_rows(dim_size, world_size, r)[0] for r in range(world_size)]
        assert starts == sorted(starts)
        assert sum(got) == dim_size
        assert all(n <= chunk_rows(dim_size, world_size) for n in got)


def test_spec_example_five_rows_on_four_ranks():
    assert [rank_rows(5, 4, r)[1] for r in range(4)] == [2, 2, 1, 0]
    layout = ShardLayout(torch.Size([5, 3]), 0, 4, 3)
    assert layout.padded_shard_size == (2, 3)
    assert layout.local_shard_size == (0, 3)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("size", [(1,), (5,), (5, 3), (8, 2, 3), (3, 4, 2)])
def test_shard_then_unshard_round_trips(size, world_size):
    tensor = torch.randn(size)
    shards = [
        shard_tensor(tensor, ShardLayout(tensor.size(), 0, world_size, r))
        for r in range(world_size)
    ]
    for r, shard in enumerate(shards):
        layout = ShardLayout(tensor.size(), 0, world_size, r)
        local = tensor.narrow(0, layout.local_offset, layout.local_rows)
        torch.testing.assert_close(shard[: layout.local_rows], local)
        assert not shard[layout.local_rows :].any(), "padding must be zeros"
    gathered = torch.stack([s.view(-1) for s in shards])
    torch.testing.assert_close(unshard_from_gathered(gathered, layout), tensor)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shard_on_dim_one_round_trips(world_size):
    tensor = torch.randn(3, 8, 2)
    layouts = [ShardLayout(tensor.size(), 1, world_size, r) for r in range(world_size)]
    shards = [shard_tensor(tensor, layout) for layout in layouts]
    for r, shard in enumerate(shards):
        torch.testing.assert_close(shard, tensor.chunk(world_size, dim=1)[r])
    gathered = torch.stack([s.reshape(-1) for s in shards])
    torch.testing.assert_close(unshard_from_gathered(gathered, layouts[0]), tensor)


def test_uneven_shard_on_dim_one_is_not_implemented():
    with pytest.raises(NotImplementedError, match="divide evenly"):
        ShardLayout(torch.Size([3, 5]), 1, 2, 0)


def test_shard_dim_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        ShardLayout(torch.Size([3, 5]), 2, 2, 0)


def test_contiguous_strides_match_torch():
    for size in [(1,), (2, 3), (4, 0, 5), (2, 3, 4, 5)]:
        assert contiguous_strides(size) == torch.empty(size).stride()


def test_pre_post_divide_factors_doubling_rule():
    assert pre_post_divide_factors(1) == (1.0, 1.0)
    assert pre_post_divide_factors(2) == (2.0, 1.0)
    assert pre_post_divide_factors(4) == (2.0, 2.0)
    assert pre_post_divide_factors(8) == (4.0, 2.0)
    assert pre_post_divide_factors(16) == (4.0, 4.0)
    for factor in [2, 3, 6, 12, 64, 1024]:
        pre, post = pre_post_divide_factors(factor)
        assert pre * post == pytest.approx(factor)
