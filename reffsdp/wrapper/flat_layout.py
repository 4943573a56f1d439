"""Pure shape math for the wrapper API's flat parameter: offsets, padding and each rank's shard.

The wrapper API (``FullyShardedDataParallel``) flattens all the parameters one instance
manages into a single 1D buffer and shards that buffer. Everything about *where* elements
live is a function of the parameters' shapes, an element size and the world size, so it is
computed here, talks to no other rank, and is tested exhaustively in one process. Tensors are
never touched: the front end slices its buffers with the numbers this module returns.

[Note: flat layout]
The parameters are laid out one after another, in the order given. With address alignment
(the front end asks for it when ``use_orig_params=True``, so that every original parameter's
view starts on a 16-byte boundary) each parameter starts at a multiple of
``16 // itemsize`` elements, with a padding segment inserted before it when needed; then a
last padding segment rounds the total up to a multiple of the world size (for a flat
parameter that is not sharded, ``NO_SHARD``, of the size of the group that all-reduces it,
as torch's). Without alignment there is no padding segment at all. ``Linear(5, 3)`` in
fp32 (4-element alignment)::

    unaligned: | weight 0..15 | bias 15..18 |                         18 elements
    aligned:   | weight 0..15 | pad 15..16 | bias 16..19 | pad 19..20 |  20 elements (2 ranks)

[Note: flat chunk semantics]
The flat buffer is split like ``torch.chunk(world_size)``: every rank gets
``c = ceil(total / world_size)`` elements except trailing ranks, which may be short or empty
(see [Note: chunk semantics] in ``sharding.py``), and every rank pads its chunk with zeros
to ``c`` elements. Rank ``r``'s shard therefore covers flat indices ``[r * c, (r + 1) * c)``,
and the all-gathered buffer holds ``c * world_size`` elements whose first ``total`` are the
flat parameter. With 18 elements on 4 ranks, ``c = 5`` and the chunks hold 5, 5, 5, 3.

[Note: a parameter's piece of a shard]
Parameter ``i`` occupies flat ``[p, p + n)``; a shard covers ``[s, e)``. The parameter is in
the shard when ``s < p + n and p < e``, which for ``n > 0`` is "they overlap". A parameter
with no elements (``n = 0``) thus counts as in the shard only when ``s < p < e`` strictly,
a corner torch's flat parameter decides the same way. The piece in the shard is
``flatten(param)[intra_param_start:intra_param_end]``, stored at
``shard[offset_in_shard : offset_in_shard + numel_in_shard]``. Unlike torch's metadata, whose
end index is inclusive, ``intra_param_end`` here is exclusive, like a Python slice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reffsdp.core.sharding import chunk_rows, rank_rows

ALIGNMENT_BYTES = 16


def alignment_numel(itemsize: int) -> int:
    """Elements per 16-byte alignment unit; 0 (no alignment) for elements wider than that.

    >>> alignment_numel(4), alignment_numel(2), alignment_numel(8), alignment_numel(32)
    (4, 8, 2, 0)
    """
    if itemsize < 1:
        raise ValueError(f"itemsize must be a positive number of bytes, got {itemsize}")
    return ALIGNMENT_BYTES // itemsize


@dataclass(frozen=True)
class FlatSegment:
    """One run of the flat buffer: a parameter (``param_index``) or padding (``None``)."""

    offset: int  # flat index where the run starts
    numel: int
    param_index: int | None

    @property
    def is_padding(self) -> bool:
        return self.param_index is None


@dataclass(frozen=True)
class ParamShardInfo:
    """Where one parameter's piece of a rank's shard lies; see [Note: a parameter's piece of
    a shard]. Every field but ``in_shard`` is ``None`` for a parameter not in the shard."""

    in_shard: bool
    offset_in_shard: int | None  # index into the rank's 1D shard
    numel_in_shard: int | None
    intra_param_start: int | None  # index into the flattened parameter
    intra_param_end: int | None  # exclusive

    @staticmethod
    def absent() -> ParamShardInfo:
        return ParamShardInfo(False, None, None, None, None)


@dataclass(frozen=True)
class RankShard:
    """One rank's shard of the flat buffer (see [Note: flat chunk semantics])."""

    rank: int
    flat_start: int  # flat index of the shard's first element: rank * shard_numel
    shard_numel: int  # every rank's shard size, padding included
    numel_padded: int  # zeros after this rank's chunk to reach shard_numel
    params: tuple[ParamShardInfo, ...]  # one per original parameter, in order

    @property
    def flat_end(self) -> int:
        """Flat index just past the shard (may lie past the buffer on padded ranks)."""
        return self.flat_start + self.shard_numel


@dataclass(frozen=True)
class FlatLayout:
    """The flat buffer of one wrapper instance and how it is sharded.

    Build it with :func:`flat_layout`. ``segments`` lists every run of the buffer in order,
    padding included; the properties give the per-parameter and per-rank views of it.
    """

    shapes: tuple[torch.Size, ...]  # the original parameters' shapes, ND
    segments: tuple[FlatSegment, ...]  # params and padding, in flat order, covering the buffer
    world_size: int

    @property
    def numels(self) -> tuple[int, ...]:
        """Each original parameter's numel."""
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def param_offsets(self) -> tuple[int, ...]:
        """Flat index where each original parameter starts."""
        return tuple(seg.offset for seg in self.segments if not seg.is_padding)

    @property
    def numels_with_padding(self) -> tuple[int, ...]:
        """Every segment's numel, padding included (torch's ``_numels_with_padding``)."""
        return tuple(seg.numel for seg in self.segments)

    @property
    def is_padding_mask(self) -> tuple[bool, ...]:
        return tuple(seg.is_padding for seg in self.segments)

    @property
    def total_numel(self) -> int:
        """Numel of the flat parameter itself, alignment padding included."""
        return sum(seg.numel for seg in self.segments)

    @property
    def shard_numel(self) -> int:
        """Every rank's shard size: the first chunk's size."""
        return chunk_rows(self.total_numel, self.world_size)

    @property
    def padded_numel(self) -> int:
        """The all-gathered buffer's numel: ``total_numel`` rounded up to the world size."""
        return self.shard_numel * self.world_size

    def rank_shard(self, rank: int) -> RankShard:
        """Rank ``rank``'s shard: its range, its padding and each parameter's piece of it.

        >>> layout = flat_layout([(3, 5), (3,)], world_size=4)  # Linear(5, 3), 18 numel
        >>> [(s.flat_start, s.numel_padded) for s in map(layout.rank_shard, range(4))]
        [(0, 0), (5, 0), (10, 0), (15, 2)]
        >>> layout.rank_shard(3).params[1]  # doctest: +NORMALIZE_WHITESPACE
        ParamShardInfo(in_shard=True, offset_in_shard=0, numel_in_shard=3,
                       intra_param_start=0, intra_param_end=3)
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        shard_numel = self.shard_numel
        chunk_numel = rank_rows(self.total_numel, self.world_size, rank)[1]
        start = rank * shard_numel
        params = tuple(
            _piece_in_shard(seg.offset, seg.numel, start, start + shard_numel)
            for seg in self.segments
            if not seg.is_padding
        )
        return RankShard(rank, start, shard_numel, shard_numel - chunk_numel, params)


def _piece_in_shard(param_start: int, numel: int, start: int, end: int) -> ParamShardInfo:
    """The piece of flat ``[param_start, param_start + numel)`` in the shard ``[start, end)``."""
    if not (start < param_start + numel and param_start < end):
        return ParamShardInfo.absent()
    intra_start = max(start - param_start, 0)
    intra_end = min(param_start + numel, end) - param_start
    offset = max(param_start - start, 0)
    return ParamShardInfo(True, offset, intra_end - intra_start, intra_start, intra_end)


def flat_layout(
    shapes: Sequence[torch.Size | Sequence[int]],
    world_size: int,
    *,
    align_itemsize: int | None = None,
    pad_multiple: int | None = None,
) -> FlatLayout:
    """Lay out parameters of ``shapes`` in one flat buffer sharded over ``world_size`` ranks.

    ``align_itemsize`` is the element size in bytes of the dtype forward and backward run
    in (``MixedPrecision.param_dtype`` when set, else the parameters' dtype), to start every
    parameter on a 16-byte boundary and pad the total to a multiple of ``world_size``;
    ``None`` lays them out back to back (see [Note: flat layout]). With alignment the total
    is padded to a multiple of ``pad_multiple`` instead when given (``NO_SHARD``: one rank
    holds it all, yet it is padded for the group that all-reduces it).

    ``Linear(5, 3)`` (18 numel) on 2 ranks: 9 each, rank 0 holding the first 9 weight
    elements, rank 1 the last 6 and the bias:

    >>> plain = flat_layout([(3, 5), (3,)], world_size=2)
    >>> plain.param_offsets, plain.total_numel, plain.shard_numel
    ((0, 15), 18, 9)
    >>> [(p.offset_in_shard, p.numel_in_shard) for p in plain.rank_shard(1).params]
    [(0, 6), (6, 3)]

    Aligned for fp32: one element of padding before the bias and one at the end, 20 numel,
    10 each; rank 0 holds part of the weight and none of the bias:

    >>> aligned = flat_layout([(3, 5), (3,)], world_size=2, align_itemsize=4)
    >>> aligned.numels_with_padding, aligned.is_padding_mask
    ((15, 1, 3, 1), (False, True, False, True))
    >>> aligned.param_offsets, aligned.total_numel, aligned.shard_numel
    ((0, 16), 20, 10)
    >>> [p.in_shard for p in aligned.rank_shard(0).params]
    [True, False]
    >>> aligned.rank_shard(1).params[0]  # doctest: +NORMALIZE_WHITESPACE
    ParamShardInfo(in_shard=True, offset_in_shard=0, numel_in_shard=5,
                   intra_param_start=10, intra_param_end=15)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if len(shapes) == 0:
        raise ValueError("a flat parameter needs at least one parameter, got no shapes")
    sizes = tuple(torch.Size(shape) for shape in shapes)
    alignment = 0 if align_itemsize is None else alignment_numel(align_itemsize)
    segments: list[FlatSegment] = []
    total = 0
    for index, size in enumerate(sizes):
        gap = -total % alignment if alignment else 0
        if gap:
            segments.append(FlatSegment(total, gap, None))
            total += gap
        segments.append(FlatSegment(total, math.prod(size), index))
        total += math.prod(size)
    tail = -total % (pad_multiple or world_size) if alignment else 0
    if tail:
        segments.append(FlatSegment(total, tail, None))
    return FlatLayout(sizes, tuple(segments), world_size)
