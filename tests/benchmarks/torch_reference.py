"""torch's ``fully_shard`` and ``FullyShardedDataParallel``, as ``python -m reffsdp.bench``
builds them.

They live with the tests because reffsdp is a clean room: nothing under ``reffsdp/`` or
``testing/`` imports ``torch.distributed.fsdp``, while tests may, as the reference.
``reffsdp.bench.impls`` loads this module by name (``REFERENCE_MODULE``) when it needs
torch's implementations, so the benchmark compares against torch from a source checkout
run at the repository root and reports them as skipped anywhere else. Only the torch
imports are here: the options each builder passes come from ``reffsdp.bench.impls``, the
same code that builds reffsdp's implementations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap
import torch.nn as nn

from reffsdp.bench.impls import Options, _fully_shard, _wrapper


def build_torch_fully_shard(model: nn.Module, options: Options) -> nn.Module:
    return _fully_shard(torch_fsdp, model, options)


def build_torch_fsdp(model: nn.Module, options: Options) -> nn.Module:
    # On CPU torch's wrapper must be told the device explicitly.
    return _wrapper(torch_fsdp, torch_wrap, model, options, options.device)


BUILDERS: dict[str, Callable[[nn.Module, Options], nn.Module]] = {
    "torch_fully_shard": build_torch_fully_shard,
    "torch_fsdp": build_torch_fsdp,
}
