"""Pure shape math for sharding: padding, chunking, offsets, divide factors.

Nothing here talks to other ranks: every function is a function of sizes, a world size
and a rank, so it is tested exhaustively in one process (including world sizes like 1024).

[Note: chunk semantics]
A tensor is split along its shard dim the way ``torch.chunk`` splits it: every rank's chunk
has ``c = ceil(d / world_size)`` rows except the trailing ranks, which may be short or empty.
With ``d = 5`` rows on 4 ranks, ``c = 2`` and the ranks hold ``2, 2, 1, 0`` rows. Each rank
keeps its chunk in a buffer padded to ``c`` rows with zeros, so every rank contributes the
same number of elements to a collective. Because only trailing ranks are ever short, all
padding of the gathered tensor sits at its end: the first ``prod(size)`` elements of the
gathered buffer *are* the parameter, in order.

For a shard dim ``d > 0`` we require the dim to divide evenly (no padding), as torch does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunk_rows(dim_size: int, world_size: int) -> int:
    """Rows in a full chunk: ``ceil(dim_size / world_size)``.

    >>> chunk_rows(5, 4), chunk_rows(8, 4), chunk_rows(0, 4)
    (2, 2, 0)
    """
    return -(-dim_size // world_size)


def rank_rows(dim_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of the rows ``rank`` owns, following ``torch.chunk``.

    >>> [rank_rows(5, 4, r) for r in range(4)]
    [(0, 2), (2, 2), (4, 1), (5, 0)]
    """
    c = chunk_rows(dim_size, world_size)
    start = min(rank * c, dim_size)
    end = min((rank + 1) * c, dim_size)
    return start, end - start


def contiguous_strides(size: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``size``.

    >>> contiguous_strides((2, 3, 4))
    (12, 4, 1)
    """
    strides: list[int] = []
    running = 1
    for dim in reversed(size):
        strides.append(running)
        running *= max(dim, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class ShardLayout:
    """How one tensor of ``global_size`` is split along ``shard_dim`` over ``world_size`` ranks.

    Example: a ``(5, 3)`` weight on 4 ranks, rank 3::

        padded_shard_size = (2, 3)   # every rank's buffer: c = 2 rows
        local_shard_size  = (0, 3)   # rank 3 owns no rows
        local_offset      = 5        # its (empty) rows would start at row 5
    """

    global_size: torch.Size
    shard_dim: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.shard_dim < len(self.global_size):
            raise ValueError(
                f"shard dim {self.shard_dim} is out of range for a tensor of size "
                f"{tuple(self.global_size)}"
            )
        if self.shard_dim > 0 and self.global_size[self.shard_dim] % self.world_size != 0:
            raise NotImplementedError(
                f"sharding dim {self.shard_dim} of a tensor of size {tuple(self.global_size)} "
                f"over {self.world_size} ranks needs that dim to divide evenly; uneven "
                "sharding is only supported on dim 0"
            )

    @property
    def padded_shard_size(self) -> torch.Size:
        """Size of every rank's padded shard buffer."""
        size = list(self.global_size)
        size[self.shard_dim] = chunk_rows(size[self.shard_dim], self.world_size)
        return torch.Size(size)

    @property
    def local_shard_size(self) -> torch.Size:
        """Size of the rows this rank really owns (padding excluded)."""
        size = list(self.global_size)
        size[self.shard_dim] = self.local_rows
        return torch.Size(size)

    @property
    def local_rows(self) -> int:
        return rank_rows(self.global_size[self.shard_dim], self.world_size, self.rank)[1]

    @property
    def local_offset(self) -> int:
        """Index along the shard dim where this rank's rows start."""
        return rank_rows(self.global_size[self.shard_dim], self.world_size, self.rank)[0]

    @property
    def padded_shard_numel(self) -> int:
        return math.prod(self.padded_shard_size)

    @property
    def local_shard_numel(self) -> int:
        return math.prod(self.local_shard_size)

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_size)


def shard_tensor(tensor: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's padded shard of ``tensor`` (a new contiguous tensor).

    Two ranks, ``tensor = [a, b, c]`` on dim 0: rank 0 gets ``[a, b]``, rank 1 ``[c, 0]``.
    """
    padded = tensor.new_zeros(layout.padded_shard_size)
    if tensor.device.type == "meta" or layout.local_rows == 0:
        return padded
    # Cut by ``split`` and fill a narrowed pad only where there is padding: a parameter
    # tensor subclass (torchao's NF4) may support no other slicing than these.
    padded_rows = layout.padded_shard_size[layout.shard_dim]
    local = tensor.split(padded_rows, layout.shard_dim)[layout.rank]
    rows = padded
    if layout.local_rows < padded_rows:
        rows = padded.narrow(layout.shard_dim, 0, layout.local_rows)
    rows.copy_(local)
    return padded


def unshard_from_gathered(gathered: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """Rebuild the full tensor from every rank's padded shard, stacked as ``(world_size, -1)``.

    For dim 0 this is a view (the padding is at the end, see [Note: chunk semantics]); for
    dim ``d > 0`` the rank blocks are concatenated along ``d`` into a new tensor.
    """
    if layout.shard_dim == 0:
        return gathered.view(-1)[: layout.global_numel].view(layout.global_size)
    blocks = gathered.view(layout.world_size, *layout.padded_shard_size).unbind(0)
    return torch.cat(blocks, dim=layout.shard_dim)


def pre_post_divide_factors(factor: float) -> tuple[float, float]:
    """Split a gradient divide factor into a divide before and after a summing reduction.

    Dividing everything before the sum can underflow; dividing everything after can
    overflow (in fp16). So ``pre`` starts at 1 and doubles while it still divides
    ``factor`` and is smaller than ``factor / pre``; ``post = factor / pre``. For a power of
    two ``pre`` ends near the square root (``pre >= post``). Doubling stops at the first
    power of two past a factor of ``factor``, so for other factors ``pre`` need not divide
    ``factor``: 3 splits into 2 and 1.5, 6 into 4 and 1.5. Torch's FSDP splits the same way,
    so reduced gradients agree bit for bit.

    >>> [pre_post_divide_factors(f) for f in (1, 2, 4, 8, 16)]
    [(1.0, 1.0), (2.0, 1.0), (2.0, 2.0), (4.0, 2.0), (4.0, 4.0)]
    >>> [pre_post_divide_factors(f) for f in (3, 6, 12)]
    [(2.0, 1.5), (4.0, 1.5), (4.0, 3.0)]
    """
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre
