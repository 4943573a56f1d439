"""A few training steps of one configuration on one GPU (NCCL, world size 1), for torch's
CUDA stream sanitizer.

``python tests/gpu/sanitized_training.py CONFIG`` trains :class:`MLPBlocks` for three steps
with ``fully_shard`` or the wrapper, as ``CONFIG`` names (see :data:`CONFIGS`);
``... CONFIG RULE`` first undoes one stream rule (see :data:`PLANTS`). Run under
``TORCH_CUDA_SANITIZER=1`` it fails with torch's report when a kernel reads or writes memory
that another stream may still be using with no event or stream wait ordering the two: the
all-gather side stream (rules 1-3 of ``reffsdp/core/streams.py``), the reduction streams,
offload copies and the post-optimizer event all run here as on any GPU. The sanitizer must
be switched on before torch touches CUDA, hence a process of its own
(``tests/gpu/test_cuda_sanitizer.py`` starts one per configuration).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from reffsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from reffsdp.testing.models import MLP, MLPBlocks
from reffsdp.wrap import ModuleWrapPolicy

DEVICE = torch.device("cuda", 0)
DIM = 64
STEPS = 3


def _fully_shard(model: MLPBlocks, **kwargs) -> MLPBlocks:
    mesh = init_device_mesh("cuda", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _prefetching(model: MLPBlocks) -> MLPBlocks:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[max(i - 1, 0) : i][::-1])
    return model


def _wrapper(model: MLPBlocks, **kwargs) -> FullyShardedDataParallel:
    policy = ModuleWrapPolicy({MLP})
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, **kwargs)


# name -> (build the sharded model from a CPU model, options of the training loop)
CONFIGS: dict[str, tuple[Callable[[MLPBlocks], nn.Module], dict]] = {
    "fully_shard": (lambda m: _fully_shard(m.to(DEVICE)), {}),
    "fully_shard/prefetch": (lambda m: _prefetching(_fully_shard(m.to(DEVICE))), {}),
    "fully_shard/no-reshard": (
        lambda m: _fully_shard(m.to(DEVICE), reshard_after_forward=False),
        {},
    ),
    "fully_shard/bf16": (
        lambda m: _fully_shard(
            m.to(DEVICE),
            mp_policy=MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32),
        ),
        {},
    ),
    "fully_shard/offload": (
        lambda m: _fully_shard(m, offload_policy=CPUOffloadPolicy(pin_memory=True)),
        {},
    ),
    "fully_shard/async-unshard": (lambda m: _fully_shard(m.to(DEVICE)), {"async_unshard": True}),
    "fully_shard/no-sync": (lambda m: _fully_shard(m.to(DEVICE)), {"microbatches": 2}),
    "fully_shard/post-optim-event": (
        lambda m: _fully_shard(m.to(DEVICE)),
        {"post_optim_event": True},
    ),
    "wrapper": (
        lambda m: _wrapper(
            m.to(DEVICE),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=True,
        ),
        {},
    ),
    "wrapper/shard-grad-op": (
        lambda m: _wrapper(m.to(DEVICE), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP),
        {},
    ),
    "wrapper/bf16": (
        lambda m: _wrapper(
            m.to(DEVICE),
            mixed_precision=MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32),
        ),
        {},
    ),
    "wrapper/offload": (
        lambda m: _wrapper(m, cpu_offload=CPUOffload(offload_params=True), device_id=DEVICE),
        {},
    ),
    "wrapper/no-sync": (lambda m: _wrapper(m.to(DEVICE)), {"microbatches": 2}),
    # loading gathers the fresh model's shards, just written on the compute stream (rule 1;
    # the wrapper's summon missed it: found by the sanitizer over the parity suite)
    "wrapper/load-state-dict": (lambda m: _wrapper(m.to(DEVICE)), {"reload": True}),
    "fully_shard/load-state-dict": (lambda m: _fully_shard(m.to(DEVICE)), {"reload": True}),
}


def train(config: str) -> list[float]:
    build, options = CONFIGS[config]
    options = dict(options)
    reload = options.pop("reload", False)
    torch.manual_seed(0)
    model = build(MLPBlocks(DIM, (3, 4)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if reload and step == 1:  # load the trained weights into a freshly sharded model
            model = _reloaded(model, build(MLPBlocks(DIM, (3, 4))))
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses.append(_step(model, optim, step, **options))
    return losses


def _reloaded(model: nn.Module, fresh: nn.Module) -> nn.Module:
    """``fresh`` with ``model``'s full (wrapper) or sharded (``fully_shard``) state dict."""
    if not isinstance(model, FullyShardedDataParallel):
        fresh.load_state_dict(model.state_dict())
        return fresh
    full = StateDictType.FULL_STATE_DICT
    with FullyShardedDataParallel.state_dict_type(model, full):
        state = model.state_dict()
    with FullyShardedDataParallel.state_dict_type(fresh, full):
        fresh.load_state_dict(state)
    return fresh


def _step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    step: int,
    *,
    microbatches: int = 1,
    async_unshard: bool = False,
    post_optim_event: bool = False,
) -> float:
    loss_sum = 0.0
    for micro in range(microbatches):
        with _gradient_sync(model, micro == microbatches - 1):
            if async_unshard:
                model.unshard(async_op=True)  # the forward waits for it
            loss = model(torch.randn(8, DIM, device=DEVICE)).square().mean()
            loss.backward()
        loss_sum += loss.item()
    optim.step()
    if post_optim_event:
        model.set_post_optim_event(torch.cuda.current_stream().record_event())
    optim.zero_grad()
    return loss_sum


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce gradients in the enclosed backward or, with ``sync`` unset, accumulate them."""
    if isinstance(model, FullyShardedDataParallel):
        with contextlib.nullcontext() if sync else model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(sync)
    yield


# a rule of reffsdp/core/streams.py to break -> (module, function name): the function is made a
# no-op, so a run shows that the sanitizer reports what the rule prevents
PLANTS = {
    "rule-1": ("reffsdp.core.streams", "AllGatherStream.wait_for_compute"),
    "rule-2": ("reffsdp.core.collectives", "wait_event_on_current_stream"),
}


def plant(rule: str) -> None:
    module_name, path = PLANTS[rule]
    owner = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for attribute in outer:
        owner = getattr(owner, attribute)
    setattr(owner, name, lambda *args, **kwargs: None)


def main(argv: list[str]) -> int:
    """``CONFIG [RULE]``: train ``CONFIG``, with ``RULE`` of :data:`PLANTS` broken if given."""
    config, *rules = argv
    for rule in rules:
        plant(rule)
    torch.cuda.set_device(DEVICE)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=DEVICE)
        try:
            losses = train(config)
            torch.cuda.synchronize()
        finally:
            dist.destroy_process_group()
    print(f"{config}: losses {losses}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
