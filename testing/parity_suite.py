"""The parity suite: sharded training against ``DistributedDataParallel``, scenario by scenario.

Each scenario builds a model, copies it for the DDP reference, shards the original with
``reffsdp.fully_shard`` on some mesh, and runs :func:`check_train_parity` (losses, gradients
and parameters compared at every step). Run it from the command line::

    python -m reffsdp.testing                      # gloo processes on CPU, 4 ranks
    python -m reffsdp.testing --world-size 2 --only mlp
    python -m reffsdp.testing --backend threaded --device cuda   # one GPU, 4 threads

Meshes: 1D, HSDP ``(2, n/2)``, and ND with tensor parallelism ``(n/2, tp=2)`` and
``(2, n/4, tp=2)``. Scenarios that need more ranks than ``--world-size`` (HSDP and 2D
need an even number >= 4, the 3D mesh 8) are skipped. The exit code is non-zero when any
scenario fails.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from reffsdp import MixedPrecisionPolicy, fully_shard

from .inputs import random_inputs, random_tokens
from .meshes import mesh_1d, mesh_dp_tp, mesh_hsdp, mesh_nd
from .models import ConvNet, MLPStack, ModelArgs, Transformer, init_deterministic
from .parity import check_train_parity, gradient_sync_off


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[torch.device], None]
    min_world_size: int = 1
    needs_even_world: bool = False

    def applies_to(self, world_size: int) -> bool:
        if world_size < self.min_world_size:
            return False
        return not self.needs_even_world or world_size % 2 == 0


def _same_on_all_ranks(model: nn.Module) -> nn.Module:
    """Broadcast rank 0's parameters and buffers (threaded ranks share one RNG)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    return model


def _mlp_stack(mesh_fn: Callable[[], Any], reshard: bool | int | None, **fsdp_kwargs: Any):
    def run(device: torch.device) -> None:
        model = init_deterministic(MLPStack(7)).to(device)
        ref = copy.deepcopy(model)
        mesh = mesh_fn()
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **fsdp_kwargs)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **fsdp_kwargs)
        check_train_parity(None, ref, model, random_inputs(3, 7, device=device), num_steps=3)

    return run


def _transformer(mesh_fn: Callable[[], Any], **args: Any):
    def run(device: torch.device) -> None:
        model_args = ModelArgs(**args)
        model = _same_on_all_ranks(Transformer(model_args).to(device))
        ref = copy.deepcopy(model)
        mesh = mesh_fn()
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        make = random_tokens(model_args.vocab_size, 2, 8, device=device)
        check_train_parity(None, ref, model, make, num_steps=3)

    return run


def _tensor_parallel(replicate: int):
    """MLP blocks with colwise/rowwise tensor parallelism (tp = 2), sharded by FSDP on the
    data-parallel dims: a ``(dp_shard, tp)`` mesh, or ``(dp_replicate, dp_shard, tp)``."""

    def run(device: torch.device) -> None:
        tp = 2
        shard = dist.get_world_size() // (replicate * tp)
        if replicate == 1:
            mesh = mesh_dp_tp(shard, tp, device.type)
            dp_mesh = mesh["dp_shard"]
        else:
            mesh = mesh_nd(replicate, shard, tp, device.type)
            dp_mesh = mesh["dp_replicate", "dp_shard"]
        model = init_deterministic(MLPStack(8)).to(device)
        ref = copy.deepcopy(model)
        plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        for block in model:
            parallelize_module(block, mesh["tp"], plan)
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        # Ranks of one tensor-parallel group (consecutive ranks) see the same batch.
        make = random_inputs(3, 8, device=device, same_within=tp)
        check_train_parity(None, ref, model, make, num_steps=3)

    return run


def _convnet(device: torch.device) -> None:
    model = _same_on_all_ranks(ConvNet(width=4).to(device))
    ref = copy.deepcopy(model)
    fully_shard(model, mesh=mesh_1d(device.type))
    check_train_parity(None, ref, model, random_inputs(2, 3, 6, 6, device=device), num_steps=3)


def _microbatches(device: torch.device) -> None:
    model = init_deterministic(MLPStack(6)).to(device)
    ref = copy.deepcopy(model)
    for block in model:
        fully_shard(block, mesh=mesh_1d(device.type))
    fully_shard(model, mesh=mesh_1d(device.type))

    check_train_parity(
        None,
        ref,
        model,
        random_inputs(2, 6, device=device),
        num_steps=2,
        num_microbatches=3,
        no_sync=gradient_sync_off,
    )


def scenarios(device_type: str) -> list[Scenario]:
    one_d = lambda: mesh_1d(device_type)  # noqa: E731
    hsdp = lambda: mesh_hsdp(2, dist.get_world_size() // 2, device_type)  # noqa: E731
    return [
        Scenario("mlp/1d/reshard", _mlp_stack(one_d, True)),
        Scenario("mlp/1d/no-reshard", _mlp_stack(one_d, False)),
        Scenario("mlp/1d/default", _mlp_stack(one_d, None)),
        Scenario("mlp/1d/reshard-to-2", _mlp_stack(one_d, 2), min_world_size=4),
        Scenario("mlp/1d/microbatches-no-sync", _microbatches),
        Scenario(
            "mlp/1d/fp32-reduce-mp",
            _mlp_stack(one_d, True, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)),
        ),
        Scenario("transformer/1d/tied", _transformer(one_d, weight_tying=True)),
        Scenario(
            "transformer/1d/checkpointed",
            _transformer(one_d, checkpoint_activations=True),
        ),
        Scenario("convnet/1d", _convnet),
        Scenario("mlp/hsdp", _mlp_stack(hsdp, True), min_world_size=4, needs_even_world=True),
        Scenario(
            "transformer/hsdp",
            _transformer(hsdp, weight_tying=True),
            min_world_size=4,
            needs_even_world=True,
        ),
        Scenario("mlp/dp-tp", _tensor_parallel(1), min_world_size=4, needs_even_world=True),
        Scenario("mlp/hsdp-tp", _tensor_parallel(2), min_world_size=8, needs_even_world=True),
    ]


@dataclasses.dataclass
class Outcome:
    name: str
    status: str  # "pass", "FAIL" or "skip"
    detail: str = ""


def run_scenarios(device: torch.device, only: str | None = None) -> list[Outcome]:
    """Run every scenario on this rank; all ranks must call it together."""
    world_size = dist.get_world_size()
    outcomes = []
    for scenario in scenarios(device.type):
        if only is not None and only not in scenario.name:
            continue
        if not scenario.applies_to(world_size):
            outcomes.append(Outcome(scenario.name, "skip", "needs other world size"))
            continue
        torch.manual_seed(0)
        try:
            scenario.run(device)
            outcomes.append(Outcome(scenario.name, "pass"))
        except AssertionError as error:  # the checker fails on every rank together
            outcomes.append(Outcome(scenario.name, "FAIL", str(error).splitlines()[0]))
        except Exception:  # noqa: BLE001 - report and stop: collectives may be misaligned
            outcomes.append(Outcome(scenario.name, "FAIL", traceback.format_exc()))
            break
        dist.barrier()
    return outcomes


def format_report(outcomes: list[Outcome], header: str) -> str:
    width = max(len(o.name) for o in outcomes) if outcomes else 10
    lines = [header]
    for outcome in outcomes:
        lines.append(f"  {outcome.name:<{width}}  {outcome.status:<4}  {outcome.detail}".rstrip())
    passed = sum(o.status == "pass" for o in outcomes)
    failed = sum(o.status == "FAIL" for o in outcomes)
    skipped = sum(o.status == "skip" for o in outcomes)
    lines.append(f"{passed} passed, {failed} failed, {skipped} skipped")
    return "\n".join(lines)


def _process_main(rank: int, world_size: int, backend: str, store_path: str, args: Any) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        outcomes = run_scenarios(device, args.only)
        if rank == 0:
            _write_result(args, outcomes, f"{backend} processes, world size {world_size}")
    finally:
        dist.destroy_process_group()


def _write_result(args: Any, outcomes: list[Outcome], header: str) -> None:
    with open(args.result_path, "w") as file:
        file.write(format_report(outcomes, header) + "\n")
        file.write("FAILED\n" if any(o.status == "FAIL" for o in outcomes) else "OK\n")


def run_in_processes(args: Any) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        mp.spawn(
            _process_main,
            args=(args.world_size, args.backend, store_path, args),
            nprocs=args.world_size,
        )


def run_in_threads(args: Any) -> None:
    from .multithread import run_threaded

    device = torch.device(args.device)

    def rank_main(rank: int) -> None:
        outcomes = run_scenarios(device, args.only)
        if rank == 0:
            _write_result(args, outcomes, f"threads on {device.type}, world size {args.world_size}")

    run_threaded(rank_main, args.world_size, timeout_s=600)
