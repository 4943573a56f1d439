"""The ``python -m reffsdp.bench`` command line.

It prints a line per implementation as it is built and per implementation and round as it
finishes, then the table. Ctrl-C ends it with exit status 130, no traceback and no rank
process left, after writing ``--json`` with what finished (``"interrupted": true``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from typing import Any

import torch

from .impls import IMPLS, Options
from .launch import heap_counter_preloaded, run_processes, run_threads
from .models import SIZES, Workload
from .report import format_table, summarize
from .runner import run_rank

DESCRIPTION = """\
Train one model with reffsdp's and torch's fully_shard and FullyShardedDataParallel, DDP
and a no-communication local baseline, in the same rank processes and interleaved rounds;
print step time, memory per rank and bytes sent per rank for each."""
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m reffsdp.bench", description=DESCRIPTION)
    p.add_argument(
        "--model",
        choices=("transformer", "mlp"),
        default="transformer",
        help="model family (default: %(default)s)",
    )
    p.add_argument("--size", choices=SIZES, default="27m", help="named size (default: %(default)s)")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks (default: 2; with nccl, every visible GPU)",
    )
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl", "threaded"),
        default=None,
        help="default: nccl with --device cuda, else gloo",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="default: cuda with --backend nccl, else cpu",
    )
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps per round (default: %(default)s)"
    )
    p.add_argument(
        "--rounds", type=int, default=4, help="interleaved rounds (default: %(default)s)"
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="CPU-offload the sharded parameters (default: off)",
    )
    p.add_argument(
        "--mixed-precision",
        nargs="?",
        const="bf16",
        choices=("bf16", "fp16"),
        default=None,
        help="parameters in this dtype (bf16 when given alone), gradients reduced in fp32 "
        "(default: off, fp32 throughout)",
    )
    p.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        help="keep parameters unsharded from forward to backward (FSDP: SHARD_GRAD_OP; "
        "default: reshard after forward, FULL_SHARD)",
    )
    p.add_argument(
        "--impl",
        nargs="+",
        choices=IMPLS,
        default=list(IMPLS),
        help="implementations to run (default: all)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results here (default: none)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="write a Chrome trace per rank of one extra round, and on CPU one of each "
        "reffsdp implementation's step on simulated GPU streams (default: none)",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="scaling tables: model size, world size, fake process group (default: off)",
    )
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on each other, and reject what cannot run."""
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if args.backend == "nccl" else 2
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.backend == "nccl" and args.device != "cuda":
        raise SystemExit("--backend nccl needs --device cuda")
    if args.backend == "nccl" and args.world_size > torch.cuda.device_count():
        raise SystemExit(
            f"--world-size {args.world_size} with nccl needs as many GPUs; "
            f"{torch.cuda.device_count()} visible"
        )
    if args.world_size < 1 or args.steps < 1 or args.rounds < 1:
        raise SystemExit("--world-size, --steps and --rounds must be at least 1")
    return args


def run_config(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The plain-data description of one run that every rank receives."""
    values = {**vars(args), **overrides}
    impls = [name for name in IMPLS if name in values["impl"]]
    return {
        "options": Options(
            workload=Workload(values["model"], values["size"]),
            device=torch.device(values["device"]),
            backend=values["backend"],
            offload=values["offload"],
            mixed_precision=values["mixed_precision"],
            reshard_after_forward=values["reshard_after_forward"],
        ),
        "impls": impls,
        "steps": values["steps"],
        "rounds": values["rounds"],
        "profile_dir": values.get("profile"),
        "threads_share_heap": values["backend"] == "threaded",
        # for the report
        "world_size": values["world_size"],
        "mixed_precision": values["mixed_precision"],
        "reshard_after_forward": values["reshard_after_forward"],
    }


def run_benchmark(
    config: dict[str, Any], finished: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """Run one configuration; ``(summary, memory note, rank 0's meta)``.

    ``finished`` receives what rank 0 announced (a record per implementation built and per
    implementation and round timed), also when the run is interrupted.
    """
    options: Options = config["options"]
    world_size = config["world_size"]
    threaded = options.backend == "threaded"
    wants_heap = options.device.type == "cpu" and not threaded
    with tempfile.TemporaryDirectory(prefix="reffsdp-bench-") as progress_dir:
        config = {**config, "progress_path": os.path.join(progress_dir, "progress.jsonl")}
        try:
            with heap_counter_preloaded(wants_heap) as why:
                if threaded:
                    ranks = run_threads(run_rank, world_size, config)
                    why = "threaded backend: ranks share one process heap, CPU memory not measured"
                else:
                    ranks = run_processes(run_rank, world_size, options.backend, config)
        finally:
            if finished is not None:
                finished.extend(_records(config["progress_path"]))
    if options.device.type == "cuda":
        why = "CUDA caching allocator (max_memory_allocated)"
    elif not why:
        why = "process-wide heap bytes (LD_PRELOAD allocator counter)"
    return summarize(ranks, config), why, ranks[0]["_meta"]


def _records(path: str) -> list[dict[str, Any]]:
    """The records rank 0 appended to ``path`` (a last one cut short is left out)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as file:
        for line in file:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def describe(config: dict[str, Any], meta: dict[str, Any]) -> str:
    options: Options = config["options"]
    extras = []
    if options.mixed_precision:
        extras.append(f"mixed precision {options.mixed_precision}")
    if options.offload:
        extras.append("CPU offload")
    if not options.reshard_after_forward:
        extras.append("no reshard after forward")
    return (
        f"{options.workload.kind} {options.workload.size} ({meta['params'] / 1e6:.1f}M params, "
        f"root {meta['root_params'] / 1e6:.2f}M), {options.backend}, {config['world_size']} "
        f"ranks on {options.device.type}, {config['rounds']} rounds x {config['steps']} steps"
        + "".join(f", {e}" for e in extras)
        + f"; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )


def main(argv: list[str] | None = None) -> int:
    args = resolve(parser().parse_args(argv))
    document: dict[str, Any] = {"interrupted": False}
    try:
        _run(args, document)
    except KeyboardInterrupt:
        document["interrupted"] = True
        print("interrupted", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(document, file, indent=2)
    return EXIT_INTERRUPTED if document["interrupted"] else 0


def _run(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """Run what ``args`` ask for, filling ``document`` (the ``--json`` one) as parts finish."""
    if args.scaling:
        from .scaling import run_scaling

        run_scaling(args, document)
        return
    config = run_config(args)
    document["config"] = _config_json(config, None)
    document["finished"] = []
    summary, memory_note, meta = run_benchmark(config, document["finished"])
    print(describe(config, meta))
    print(format_table(summary, memory_note))
    del document["finished"]  # the results say it all
    document.update(config=_config_json(config, meta), memory=memory_note, results=summary)
    if args.profile:
        print(f"Chrome traces: {os.path.join(args.profile, 'rank<r>.json')}")
    if args.profile and args.device == "cpu":
        from .stream_traces import write_stream_traces

        for path in write_stream_traces(config):
            print(f"Simulated GPU streams (Chrome trace): {path}")


def _config_json(config: dict[str, Any], meta: dict[str, Any] | None) -> dict[str, Any]:
    """The run's configuration; ``meta`` (rank 0's parameter counts) is ``None`` until the
    ranks have built the model."""
    options: Options = config["options"]
    return {
        "model": options.workload.kind,
        "size": options.workload.size,
        "params": None if meta is None else meta["params"],
        "root_params": None if meta is None else meta["root_params"],
        "world_size": config["world_size"],
        "backend": options.backend,
        "device": options.device.type,
        "steps": config["steps"],
        "rounds": config["rounds"],
        "offload": options.offload,
        "mixed_precision": options.mixed_precision,
        "reshard_after_forward": options.reshard_after_forward,
        "impls": config["impls"],
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
