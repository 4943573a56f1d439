"""What a parity check makes sure of before it compares a number.

A parity check that compares the wrong things passes or fails for reasons that have nothing
to do with sharding. These checks turn such setups into failures that say what is wrong:

* :func:`blocks_of`, :func:`unsharded_blocks` and :func:`unsharded_blocks_message`: every
  module of the block classes the test names has its own ``fully_shard`` call (or its own
  ``FullyShardedDataParallel`` instance), and those classes name at least one module.
  A forgotten ``fully_shard`` still trains correctly (the root's group takes the block's
  parameters), so only the collective counts would show it, if anyone looked.
* :func:`ranks_with_other_weights`: which ranks built a reference that differs from rank
  0's. ``DistributedDataParallel`` copies rank 0's weights into the reference when it wraps
  it, while each rank's shards were cut from its own copy; the check then fails on those
  ranks "before training" for a reason that is not a sharding bug.
* :func:`active_dropout`: dropout modules that draw masks in training mode. The reference
  and the sharded model draw different masks, so their losses differ from the first step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .impls import DEFAULT, Implementation, resolve

_DROPOUT = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)

WEIGHTS_HINT = (
    "the ranks hold different initial weights: before DistributedDataParallel copied rank "
    "0's weights into the reference, rank(s) {ranks} held other values than rank 0. This "
    "is not a sharding bug: each rank's shards were cut from its own copy. Make the model "
    "identical on every rank before copying and sharding it: "
    "`ref_model, model = reference_and_model(model)` (reffsdp.testing), "
    "`broadcast_params_from_rank0(model)`, or build it with "
    "`build_seeded(factory, seed)` (reffsdp.testing.build); threads of the threaded harness "
    "share one RNG, so models built on each rank without a seed differ."
)


def check_block_types(block_types: Sequence[type[nn.Module]]) -> tuple[type[nn.Module], ...]:
    """``block_types`` as a tuple, refused (``TypeError``) unless each is a module class."""
    types = tuple(block_types)
    wrong = [repr(t) for t in types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if wrong:
        raise TypeError(
            f"block_types must be nn.Module subclasses (e.g. type(model.layers[0])), got "
            f"{', '.join(wrong)}"
        )
    return types


def blocks_of(model: nn.Module, block_types: Sequence[type[nn.Module]]) -> list[nn.Module]:
    """The modules of ``model`` (not ``model`` itself) that are instances of ``block_types``.

    Raises ``ValueError`` when there is none: a test that names blocks and shards none of them
    on their own would check far less than it says.
    """
    types = check_block_types(block_types)
    blocks = [m for m in model.modules() if m is not model and isinstance(m, types)]
    if types and not blocks:
        names = ", ".join(t.__name__ for t in types)
        present = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ValueError(
            f"block_types ({names}) match no module of {type(model).__name__}, so no block "
            f"would be sharded on its own; its submodules are of the classes "
            f"{', '.join(present[:12])}{', ...' if len(present) > 12 else ''}"
        )
    return blocks


def unsharded_blocks(
    model: nn.Module,
    block_types: Sequence[type[nn.Module]],
    *,
    impl: Implementation | str = DEFAULT,
) -> list[str]:
    """Names of the modules of ``block_types`` in ``model`` that ``impl`` (see
    :mod:`reffsdp.testing.impls`; default reffsdp) did not shard on their own: not an
    ``FSDPModule`` (``fully_shard``) and not the module of a ``FullyShardedDataParallel``
    instance (the wrapper's auto-wrap policy or a manual wrap).

    Raises ``ValueError`` when ``block_types`` match no module (see :func:`blocks_of`).
    """
    types = check_block_types(block_types)
    api = resolve(impl).module
    per_param = getattr(api, "FSDPModule", ())
    wrapper = getattr(api, "FullyShardedDataParallel", ())
    wrapped = {id(m.module) for m in model.modules() if isinstance(m, wrapper)}
    blocks_of(model, types)
    return [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if module is not model
        and isinstance(module, types)
        and not isinstance(module, per_param)
        and id(module) not in wrapped
    ]


def unsharded_blocks_message(
    model: nn.Module,
    block_types: Sequence[type[nn.Module]],
    *,
    impl: Implementation | str = DEFAULT,
) -> str:
    """What is wrong when modules of ``block_types`` were left unsharded ("" if none)."""
    missing = unsharded_blocks(model, block_types, impl=impl) if block_types else []
    if not missing:
        return ""
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (
        f"{len(missing)} module(s) of block_types are not sharded on their own: {shown}. "
        "Their parameters went to an enclosing group, so the model trains but gathers them "
        "with it; call fully_shard on each block before the root, or add the class to the "
        "wrapper's auto_wrap_policy"
    )


def ranks_with_other_weights(model: nn.Module) -> list[int]:
    """The ranks whose parameters and buffers of ``model`` differ from rank 0's.

    Every rank of the default group calls this together. Sharded (DTensor) tensors are
    skipped: each rank holds a different piece of them by design.
    """
    tensors = [
        t.detach().reshape(-1).double()
        for t in [*model.parameters(), *model.buffers()]
        if not isinstance(t, DTensor) and t.is_floating_point()
    ]
    if not tensors:
        return []
    mine = torch.cat(tensors)
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    differs = torch.zeros(dist.get_world_size(), device=mine.device)
    differs[dist.get_rank()] = float(not torch.equal(mine, rank0))
    dist.all_reduce(differs)
    return differs.nonzero().flatten().tolist()


def active_dropout(model: nn.Module) -> list[str]:
    """Names of the dropout modules of ``model`` in training mode with ``p > 0``."""
    return [
        f"{name} (p={module.p:g})"
        for name, module in model.named_modules()
        if isinstance(module, _DROPOUT) and module.training and module.p > 0
    ]
