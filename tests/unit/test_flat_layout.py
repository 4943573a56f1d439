"""The flat parameter's layout math (``reffsdp.wrapper.flat_layout``), in one process.

Two references: a brute-force one built from real tensors (``torch.cat`` of labelled
elements, ``torch.chunk``, boolean masks), run over many shapes, world sizes 1-8 and every
alignment; and torch's own FSDP1 ``FlatParameter``, built on the fake process group for
every rank of world sizes 1-4 and compared attribute by attribute.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.nn as nn

from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.wrapper.flat_layout import (
    FlatLayout,
    ParamShardInfo,
    alignment_numel,
    flat_layout,
)

PAD = -1  # owner label of alignment / world-size padding
SHARD_PAD = -2  # owner label of the zeros a rank appends to its chunk

SHAPE_LISTS = [
    [(1,)],
    [(5,)],
    [(3, 5), (3,)],
    [(7,), (1,), (2, 3), (4,)],
    [(2, 2, 2), (5,), (0,), (3,)],
    [(0, 3), (6,)],
    [(17,), (9, 2), (1, 1), (31,)],
    [(64,), (64,)],
    [(1,)] * 9,
    [(3,), (0,), (0,), (5,)],
]
ITEMSIZES = [None, 1, 2, 4, 8, 16]


def _brute_force_flat(shapes, alignment: int, world_size: int):
    """``(owner, position)`` label tensors of the flat buffer, built element by element."""
    owner: list[int] = []
    position: list[int] = []
    for index, shape in enumerate(shapes):
        while alignment and len(owner) % alignment:
            owner.append(PAD)
            position.append(-1)
        owner += [index] * math.prod(shape)
        position += list(range(math.prod(shape)))
    while alignment and len(owner) % world_size:
        owner.append(PAD)
        position.append(-1)
    return torch.tensor(owner, dtype=torch.long), torch.tensor(position, dtype=torch.long)


def _brute_force_shard(owner: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's padded shard of ``owner``, as FSDP1 builds it from ``torch.chunk``."""
    chunks = owner.chunk(world_size)
    chunk = chunks[rank] if rank < len(chunks) else owner.new_empty(0)
    padding = chunks[0].numel() - chunk.numel()
    return torch.cat([chunk, owner.new_full((padding,), SHARD_PAD)])


def _check_against_brute_force(layout: FlatLayout, shapes, alignment: int, world_size: int):
    owner, position = _brute_force_flat(shapes, alignment, world_size)
    assert layout.total_numel == owner.numel()
    assert layout.padded_numel % world_size == 0
    assert layout.padded_numel - layout.total_numel < world_size
    for index, offset in enumerate(layout.param_offsets):
        numel = math.prod(shapes[index])
        if numel:
            assert (owner == index).nonzero()[0].item() == offset
        assert layout.numels[index] == numel
        if alignment:
            assert offset % alignment == 0
    for rank in range(world_size):
        shard = layout.rank_shard(rank)
        owned = _brute_force_shard(owner, world_size, rank)
        shard_positions = _brute_force_shard(position, world_size, rank)
        assert shard.shard_numel == owned.numel() == layout.shard_numel
        assert shard.numel_padded == int((owned == SHARD_PAD).sum())
        assert shard.flat_start == rank * shard.shard_numel
        for index, info in enumerate(shard.params):
            mask = owned == index
            if math.prod(shapes[index]) == 0:
                _check_empty_param(info, layout.param_offsets[index], shard)
                continue
            assert info.in_shard == bool(mask.any())
            if not info.in_shard:
                assert info == ParamShardInfo.absent()
                continue
            where = mask.nonzero().flatten()
            assert info.offset_in_shard == where[0].item()
            assert info.numel_in_shard == where.numel()
            assert where[-1].item() - where[0].item() + 1 == where.numel()  # one run
            assert info.intra_param_start == shard_positions[where[0]].item()
            assert info.intra_param_end == shard_positions[where[-1]].item() + 1


def _check_empty_param(info: ParamShardInfo, offset: int, shard) -> None:
    """A zero-numel parameter is in a shard only when strictly inside it (torch's rule)."""
    inside = shard.flat_start < offset < shard.flat_end
    assert info.in_shard == inside
    if inside:
        assert info == ParamShardInfo(True, offset - shard.flat_start, 0, 0, 0)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("world_size", range(1, 9))
def test_layout_matches_brute_force(world_size, itemsize):
    for shapes in SHAPE_LISTS:
        layout = flat_layout(shapes, world_size, align_itemsize=itemsize)
        alignment = 0 if itemsize is None else alignment_numel(itemsize)
        _check_against_brute_force(layout, shapes, alignment, world_size)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_pieces_tile_every_parameter(itemsize):
    """Across ranks, each parameter's pieces cover it exactly once, in rank order."""
    for shapes, world_size in itertools.product(SHAPE_LISTS, range(1, 9)):
        layout = flat_layout(shapes, world_size, align_itemsize=itemsize)
        for index, numel in enumerate(layout.numels):
            pieces = [
                layout.rank_shard(rank).params[index]
                for rank in range(world_size)
                if layout.rank_shard(rank).params[index].numel_in_shard
            ]
            covered = [(p.intra_param_start, p.intra_param_end) for p in pieces]
            bounds = [0] + [end for _, end in covered]
            assert [start for start, _ in covered] == bounds[:-1]
            assert bounds[-1] == numel


def test_segments_cover_the_buffer():
    layout = flat_layout([(7,), (1,), (2, 3)], 4, align_itemsize=4)
    ends = [seg.offset + seg.numel for seg in layout.segments]
    assert [seg.offset for seg in layout.segments] == [0, *ends[:-1]]
    assert ends[-1] == layout.total_numel
    assert layout.numels_with_padding == (7, 1, 1, 3, 6, 2)
    assert layout.is_padding_mask == (False, True, False, True, False, True)


def test_empty_shards():
    """5 elements on 4 ranks: chunks of 2, 2, 1 and an empty one, all padded to 2."""
    layout = flat_layout([(5,)], 4)
    shards = [layout.rank_shard(rank) for rank in range(4)]
    assert [s.numel_padded for s in shards] == [0, 0, 1, 2]
    assert shards[3].params == (ParamShardInfo.absent(),)
    assert shards[2].params[0] == ParamShardInfo(True, 0, 1, 4, 5)
    # 6 elements on 4 ranks: torch.chunk makes only three chunks of 2.
    assert [flat_layout([(6,)], 4).rank_shard(r).numel_padded for r in range(4)] == [0, 0, 0, 2]


def test_unaligned_layout_has_no_padding_segments():
    layout = flat_layout([(3,), (5,)], 4)
    assert layout.is_padding_mask == (False, False)
    assert (layout.total_numel, layout.padded_numel) == (8, 8)
    assert flat_layout([(3,), (6,)], 4).padded_numel == 12


def test_wide_elements_are_not_aligned():
    """Elements wider than 16 bytes get no alignment, so no world-size padding either."""
    layout = flat_layout([(3,), (5,)], 4, align_itemsize=32)
    assert layout.is_padding_mask == (False, False)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: flat_layout([(2,)], 0), "world_size"),
        (lambda: flat_layout([], 2), "at least one parameter"),
        (lambda: flat_layout([(2,)], 2, align_itemsize=0), "itemsize"),
        (lambda: flat_layout([(2,)], 2).rank_shard(2), "rank"),
        (lambda: flat_layout([(2,)], 2).rank_shard(-1), "rank"),
    ],
)
def test_bad_input_raises(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- against torch's FSDP1 FlatParameter --------------------------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.mid = nn.Linear(3, 5)
        self.out = nn.Linear(3, 7, bias=False)
        self.out.weight = self.embed.weight


MODELS = {
    "linear": lambda: nn.Linear(5, 3),
    "mlp_with_empty": lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 0), nn.Linear(3, 7)),
    "tied": _Tied,
    "conv": lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(9, 2)),
    "fp64": lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).double(),
}


def _torch_flat_param(model: nn.Module, world_size: int, rank: int, **kwargs):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with fake_process_group(world_size, rank), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 -> NO_SHARD, and similar notices
        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), **kwargs)
    return wrapped._flat_param


def _torch_infos(flat_param) -> tuple[ParamShardInfo, ...]:
    """torch's shard infos with the end made exclusive, like ours."""
    return tuple(
        ParamShardInfo(
            i.in_shard,
            i.offset_in_shard,
            i.numel_in_shard,
            i.intra_param_start_idx,
            None if i.intra_param_end_idx is None else i.intra_param_end_idx + 1,
        )
        for i in flat_param._shard_param_infos
    )


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("mixed_precision", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_matches_torch_flat_parameter(model_name, use_orig_params, mixed_precision):
    from torch.distributed.fsdp import MixedPrecision

    kwargs = {"use_orig_params": use_orig_params}
    compute_dtype = None
    if mixed_precision:
        compute_dtype = torch.bfloat16
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=compute_dtype)
    for world_size in range(1, 5):
        for rank in range(world_size):
            model = MODELS[model_name]()
            params = list(model.parameters())  # deduplicated, in the order FSDP1 flattens
            itemsize = (compute_dtype or params[0].dtype).itemsize
            layout = flat_layout(
                [p.shape for p in params],
                world_size,
                align_itemsize=itemsize if use_orig_params else None,
            )
            flat_param = _torch_flat_param(model, world_size, rank, **kwargs)
            shard = layout.rank_shard(rank)
            where = f"{model_name} world size {world_size} rank {rank}"
            assert layout.shapes == tuple(flat_param._shapes), where
            assert layout.numels == flat_param._numels, where
            assert layout.numels_with_padding == flat_param._numels_with_padding, where
            assert list(layout.is_padding_mask) == list(flat_param._is_padding_mask), where
            assert layout.total_numel == flat_param._unpadded_unsharded_size.numel(), where
            assert torch.Size([shard.shard_numel]) == flat_param._sharded_size, where
            assert shard.numel_padded == flat_param._shard_numel_padded, where
            assert shard.params == _torch_infos(flat_param), where


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_unsharded_matches_torch_flat_parameter(model_name):
    """``NO_SHARD``: one rank holds it all, aligned and padded for the all-reducing group."""
    from torch.distributed.fsdp import ShardingStrategy

    for world_size in range(1, 5):
        model = MODELS[model_name]()
        params = list(model.parameters())
        layout = flat_layout(
            [p.shape for p in params],
            1,
            align_itemsize=params[0].dtype.itemsize,
            pad_multiple=world_size,
        )
        kwargs = {"use_orig_params": True, "sharding_strategy": ShardingStrategy.NO_SHARD}
        flat_param = _torch_flat_param(model, world_size, 0, **kwargs)
        where = f"{model_name} world size {world_size}"
        assert layout.numels_with_padding == flat_param._numels_with_padding, where
        assert layout.rank_shard(0).shard_numel == flat_param.numel(), where
