"""Build the two sides of a sharding test: a reference copy and the sharded model.

The usual shape of a test::

    ref_model, model = reference_and_model(MLPStack(8))  # same weights on every rank
    shard_bottom_up(model, model, reshard_after_forward=False)  # each block, then the root
    check_train_parity(self, ref_model, model, random_inputs(2, 8))

The reference is copied *before* sharding, since ``fully_shard`` changes the module in place.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from .impls import DEFAULT, Implementation, resolve
from .parity import broadcast_params_from_rank0

_Module = TypeVar("_Module", bound=nn.Module)

# One build at a time in this process: threaded ranks share torch's global RNG.
_build_lock = threading.Lock()


def build_seeded(factory: Callable[[], _Module], seed: int) -> _Module:
    """``factory()`` run with torch's RNG seeded with ``seed``: the same model every time.

    Builds run one at a time, so under the threaded harness no other rank draws from the
    shared RNG in between, and every rank (and every run) gets the same weights. The
    caller's RNG state is restored afterwards.
    """
    with _build_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def reference_and_model(model: _Module) -> tuple[_Module, _Module]:
    """``(reference, model)``: ``model`` with rank 0's weights on every rank, and a copy.

    Threaded ranks share one RNG, so "the same" model built on each rank differs until rank
    0's parameters and buffers are broadcast. Every rank of the default group must call this
    together.
    """
    broadcast_params_from_rank0(model)
    return copy.deepcopy(model), model


def shard_bottom_up(
    model: _Module,
    blocks: Iterable[nn.Module],
    *,
    impl: Implementation | str = DEFAULT,
    **fsdp_kwargs: Any,
) -> _Module:
    """``fully_shard`` each of ``blocks``, then ``model`` (which takes the parameters left).

    Every call gets the same ``fsdp_kwargs`` (``mesh=``, ``reshard_after_forward=``, ...).
    ``impl`` names the implementation whose ``fully_shard`` shards (see
    :mod:`reffsdp.testing.impls`; default reffsdp). Returns ``model``, now an ``FSDPModule``.
    """
    fully_shard = resolve(impl).module.fully_shard
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def fsdp_modules(model: nn.Module, *, impl: Implementation | str = DEFAULT) -> list[nn.Module]:
    """Every module of ``model`` (itself included) that ``impl``'s ``fully_shard`` was
    applied to."""
    module_class = resolve(impl).module.FSDPModule
    return [module for module in model.modules() if isinstance(module, module_class)]


def blocks_policy(
    block_classes: Iterable[type[nn.Module]],
) -> Callable[[nn.Module, bool, int], bool]:
    """An auto-wrap policy that wraps every instance of ``block_classes``: the plain callable
    ``(module, recurse, nonwrapped_numel) -> bool`` every implementation of the wrapper
    takes (asked with ``recurse=True`` whether to look inside a module, always; with
    ``recurse=False`` whether to wrap it)."""
    classes = tuple(block_classes)

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, classes)

    return policy


def wrap_blocks(
    model: nn.Module,
    block_classes: Iterable[type[nn.Module]],
    *,
    impl: Implementation | str = DEFAULT,
    **wrapper_kwargs: Any,
) -> nn.Module:
    """The wrapper API's nested wrapping: every instance of ``block_classes`` in its own
    ``FullyShardedDataParallel`` (``impl``'s; default reffsdp's), the rest of ``model`` in
    the root one.

    ``wrapper_kwargs`` go to the root and, copied, to every block
    (``auto_wrap_policy=blocks_policy(block_classes)``).
    """
    wrapper = resolve(impl).module.FullyShardedDataParallel
    return wrapper(model, auto_wrap_policy=blocks_policy(block_classes), **wrapper_kwargs)
