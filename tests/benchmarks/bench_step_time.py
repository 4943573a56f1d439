"""Step time of reffsdp's ``fully_shard`` against torch's ``fully_shard`` and DDP.

All three train the same Transformer in the same rank processes, in interleaved rounds, so
machine noise hits them alike. Prints the median step time of each and the ratios::

    python tests/benchmarks/bench_step_time.py                     # 2 gloo ranks on CPU
    python tests/benchmarks/bench_step_time.py --backend nccl --world-size 1   # one GPU

torch's FSDP is imported here only as the reference being compared against.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel

from reffsdp import fully_shard as reffsdp_fully_shard
from reffsdp.testing.models import ModelArgs, Transformer


def _build(args: argparse.Namespace, device: torch.device) -> Transformer:
    torch.manual_seed(0)
    model_args = ModelArgs(
        n_layers=args.layers,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
        dim=args.dim,
        n_heads=args.heads,
    )
    return Transformer(model_args).to(device)


def _shard(model: Transformer, fully_shard) -> Transformer:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def _step(model, optim, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _time_steps(model, optim, tokens, steps: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, optim, tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _rank_main(rank: int, world_size: int, backend: str, store: str, args) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        backend, store=dist.FileStore(store, world_size), rank=rank, world_size=world_size
    )
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    base = _build(args, device)
    models = {
        "reffsdp": _shard(copy.deepcopy(base), reffsdp_fully_shard),
        "torch_fsdp2": _shard(copy.deepcopy(base), torch_fully_shard),
        "ddp": DistributedDataParallel(copy.deepcopy(base)),
    }
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    tokens = tokens.to(device)
    times: dict[str, list[float]] = {name: [] for name in models}
    for name in models:  # warm up
        _time_steps(models[name], optims[name], tokens, 2, device)
    for _ in range(args.rounds):
        for name in models:
            times[name].append(_time_steps(models[name], optims[name], tokens, args.steps, device))
    if rank == 0:
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{backend}, world size {world_size}, Transformer dim {args.dim} x {args.layers}")
        for name, ms in medians.items():
            print(f"  {name:<12} {ms:8.2f} ms/step")
        print(f"  reffsdp / torch_fsdp2 = {medians['reffsdp'] / medians['torch_fsdp2']:.3f}")
        print(f"  reffsdp / ddp         = {medians['reffsdp'] / medians['ddp']:.3f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _rank_main,
            args=(args.world_size, args.backend, os.path.join(tmp, "store"), args),
            nprocs=args.world_size,
        )


if __name__ == "__main__":
    main()
