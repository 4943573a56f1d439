"""The ``python -m reffsdp.bench`` command line.

It prints a line per implementation as it is built and per implementation and round as it
finishes, then the table. Ctrl-C ends it with exit status 130, no traceback and no rank
process left, after writing ``--json`` with what finished (``"interrupted": true``).

Under torchrun or srun every rank runs this command and joins the launched world instead of
spawning ranks (:mod:`reffsdp.testing.launch` decides): the backend (nccl where CUDA is
present, else gloo) and the world size are the launched world's, and rank 0 alone prints
and writes ``--json``.

The exit status is 0 when the run finished, 130 when interrupted, 2 for bad arguments (as
the parity suite's command line, ``python -m reffsdp.testing``): a value out of range, a
combination that cannot run here, or a ``--json`` file or ``--profile`` folder that cannot
be written, all refused before anything runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from typing import Any, NoReturn

import torch

from reffsdp.testing.launched_world import LaunchedEnv, LaunchError, read_launched_env

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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m reffsdp.bench", description=DESCRIPTION)
    _add_where_and_what(p)
    _add_how_to_train(p)
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


def _add_where_and_what(p: argparse.ArgumentParser) -> None:
    """The model, and the ranks, backend and device it trains on."""
    p.add_argument(
        "--model",
        choices=("transformer", "mlp"),
        default="transformer",
        help="model family (default: %(default)s)",
    )
    p.add_argument("--size", choices=SIZES, default="27m", help="named size (default: %(default)s)")
    p.add_argument(
        "--world-size",
        type=_positive_int,
        default=None,
        help="ranks (default: 2; with nccl, every visible GPU; under torchrun or srun, the "
        "launched world's)",
    )
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl", "threaded"),
        default=None,
        help="default: nccl with --device cuda, else gloo (under torchrun or srun: nccl "
        "where CUDA is present, else gloo)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="default: cuda with --backend nccl, else cpu",
    )


def _add_how_to_train(p: argparse.ArgumentParser) -> None:
    """Steps and rounds timed, the sharding options, and which implementations."""
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=3,
        help="timed steps per round (default: %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=4,
        help="interleaved rounds (default: %(default)s)",
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


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on each other, and refuse what cannot run, before
    anything runs (:func:`_usage_error`)."""
    try:
        args.launched = read_launched_env()
    except LaunchError as error:
        _usage_error(str(error))
    if args.launched is not None:
        _join_launched(args, args.launched)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if args.backend == "nccl" else 2
    if args.device == "cuda" and not torch.cuda.is_available():
        _usage_error("--device cuda: no CUDA device is visible")
    if args.backend == "nccl" and args.device != "cuda":
        _usage_error("--backend nccl needs --device cuda")
    spawns_nccl = args.launched is None and args.backend == "nccl"
    if spawns_nccl and args.world_size > torch.cuda.device_count():
        _usage_error(
            f"--world-size {args.world_size} with nccl needs as many GPUs; "
            f"{torch.cuda.device_count()} visible"
        )
    _check_outputs(args)
    return args


def _join_launched(args: argparse.Namespace, launched: LaunchedEnv) -> None:
    """Take backend, device and world size from the launched world; a different one given
    is refused, naming both."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    where = f"{launched.launcher} launched {launched.world_size} ranks"
    if args.scaling:
        _usage_error(
            f"--scaling starts worlds of several sizes itself, but {where}; run it without "
            "a launcher"
        )
    if args.backend not in (None, backend):
        _usage_error(
            f"--backend {args.backend} conflicts with the launched world: {where}, which "
            f"runs on {backend} here; drop --backend"
        )
    if args.world_size not in (None, launched.world_size):
        _usage_error(
            f"--world-size {args.world_size} conflicts with the launched world: {where}; "
            "drop --world-size (or launch that many ranks)"
        )
    if backend == "nccl" and torch.cuda.device_count() < launched.local_world_size:
        _usage_error(
            f"{launched.launcher} put {launched.local_world_size} ranks on this node, which "
            f"has {torch.cuda.device_count()} GPUs; nccl runs one rank per GPU"
        )
    args.backend, args.world_size = backend, launched.world_size


def _check_outputs(args: argparse.Namespace) -> None:
    """``--json`` (written by the reporting process) and ``--profile`` (every rank writes
    its trace there) must be writable, so that a run never ends in a traceback over a path
    it could have refused at the start."""
    outputs = [("--profile", args.profile, True)]
    if _reports(args):
        outputs.append(("--json", args.json, False))
    for flag, path, is_folder in outputs:
        problem = None if path is None else _unwritable(path, is_folder=is_folder)
        if problem:
            kind = "folder" if is_folder else "file name"
            _usage_error(f"{flag} {path}: {problem}; give a {kind} you can write")


def _usage_error(message: str) -> NoReturn:
    """Print the usage and ``message`` and exit with status 2, as argparse does for
    arguments it refuses itself."""
    parser().error(message)


def _unwritable(path: str, *, is_folder: bool) -> str | None:
    """Why the file (or folder) ``path`` cannot be written (``None`` when it can), found
    without writing anything: missing folders are created when the results are written."""
    if is_folder and os.path.exists(path) and not os.path.isdir(path):
        return "is not a folder"
    if not is_folder and os.path.isdir(path):
        return "is a folder"
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a folder"
    target = path if os.path.exists(path) else existing
    if not os.access(target, os.W_OK):
        return f"{target} is not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    args = resolve(parser().parse_args(argv))
    if not _reports(args):
        args.json = None  # rank 0 of the launched world prints and writes
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            return _main(args)
    return _main(args)


def _reports(args: argparse.Namespace) -> bool:
    """Whether this process prints and writes: rank 0 of a launched world, or the launcher."""
    return args.launched is None or args.launched.rank == 0


def _main(args: argparse.Namespace) -> int:
    document: dict[str, Any] = {"interrupted": False}
    try:
        _run(args, document)
    except KeyboardInterrupt:
        document["interrupted"] = True
        print("interrupted", file=sys.stderr)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
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
    if args.profile and args.device == "cpu" and _reports(args):
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
        **config["launch"],
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
