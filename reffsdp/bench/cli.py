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
from typing import Any

import torch

from .impls import IMPLS, Options
from .models import SIZES
from .report import format_table
from .run import describe, run_benchmark, run_config
from .scaling import run_scaling

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
