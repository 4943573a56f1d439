"""A small trainer written against torch's FSDP only (it imports nothing from reffsdp), for
``test_swap.py``: run as it is, it trains on torch's FSDP; under ``python -m reffsdp.swap``
it must train on reffsdp's, with the same results. Not collected on its own.

Run by torchrun on 2 ranks (gloo): ``--out FILE`` gets rank 0's record: what the modules'
classes are, whether the trainer's ``isinstance`` checks held, losses and parameters, for
``fully_shard`` (gradients accumulated over two micro-batches, the first without syncing on
the modules ``isinstance(m, FSDPModule)`` finds) and for ``FullyShardedDataParallel``
(FULL_SHARD, its modules found by class).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (
    FSDPModule,
    FullyShardedDataParallel,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, sync=lambda last: None) -> list[float]:
    """``STEPS`` steps of two micro-batches each; ``sync(last)`` before each backward."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        for last in (False, True):
            batch = torch.randn(4, 8, generator=generator)
            loss = model(batch).pow(2).mean()
            sync(last)
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def with_fully_shard() -> dict:
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]

    def sync(last: bool) -> None:  # what a trainer sets only on modules it recognises
        for module in sharded:
            module.set_requires_gradient_sync(last, recurse=False)

    losses = _train(model, sync)
    params = [param.full_tensor().sum().item() for param in model.parameters()]
    return {"class": type(model).__module__, "recognised": len(sharded), "losses": losses,
            "params": params}  # fmt: skip


def with_the_wrapper() -> dict:
    model = FullyShardedDataParallel(
        _model(),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    wrapped = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    losses = _train(model)
    with FullyShardedDataParallel.summon_full_params(model):
        params = [param.sum().item() for param in model.parameters()]
    return {"class": type(model).__module__, "recognised": len(wrapped), "losses": losses,
            "params": params}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    record = {"fully_shard": with_fully_shard(), "wrapper": with_the_wrapper()}
    if dist.get_rank() == 0:
        with open(args.out, "w") as file:
            json.dump(record, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Under torchrun, torch 2.13's gloo workers abort in the interpreter's teardown in about
    # one run of seven ("terminate called without an active exception", exit -6), whichever
    # FSDP trained, torch's included; the results are written by then, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
