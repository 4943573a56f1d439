"""Inputs for parity checks: different per rank and per iteration, and reproducible.

``check_train_parity`` asks for ``make_inputs(iteration, rank)``. The factories below build
one from a shape. Each call draws from its own generator seeded with
``1000 * iteration + rank // same_within``, so the data never depends on the global RNG,
which threaded ranks share and race on. ``same_within=tp`` gives the ranks of one
tensor-parallel group (consecutive ranks) the same data, as tensor parallelism expects.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MakeInputs = Callable[[int, int], torch.Tensor]


def _generator(iteration: int, rank: int, same_within: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * iteration + rank // same_within)


def random_inputs(
    *shape: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    same_within: int = 1,
) -> MakeInputs:
    """``make_inputs`` returning standard-normal tensors of ``shape``."""

    def make(iteration: int, rank: int) -> torch.Tensor:
        values = torch.randn(shape, generator=_generator(iteration, rank, same_within))
        return values.to(device=device, dtype=dtype)

    return make


def random_tokens(
    vocab_size: int,
    *shape: int,
    device: torch.device | str | None = None,
    same_within: int = 1,
) -> MakeInputs:
    """``make_inputs`` returning token ids in ``[0, vocab_size)`` of ``shape``."""

    def make(iteration: int, rank: int) -> torch.Tensor:
        generator = _generator(iteration, rank, same_within)
        return torch.randint(0, vocab_size, shape, generator=generator).to(device)

    return make
