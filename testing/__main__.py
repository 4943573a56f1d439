"""``python -m reffsdp.testing`` (installed as ``reffsdp-parity``): run the parity suite.

The suite trains reffsdp-sharded models next to ``DistributedDataParallel`` and checks that
losses, gradients, parameters and the collectives issued agree, scenario by scenario
(:mod:`reffsdp.testing.parity_suite` runs them). This module is the command line around it::

    python -m reffsdp.testing                                # threaded ranks on CPU
    python -m reffsdp.testing --list --mesh hsdp             # names, nothing runs
    python -m reffsdp.testing --api wrapper --only '*/bf16/*' --json out.json
    python -m reffsdp.testing --backend nccl --world-size 1 --junit-xml parity.xml
    python -m reffsdp.testing --self-test                    # are planted bugs caught?

The exit status is 0 when every scenario passed or was skipped (for ``--self-test``: when
every planted bug was caught), 1 otherwise, 2 for bad arguments. Formatting lives in
:mod:`reffsdp.testing.report`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TextIO

import torch

from . import report

# What this command line uses of the engine, reffsdp.testing.parity_suite.
ENGINE_NAMES = ("SuiteOptions", "list_scenarios", "run_suite", "run_self_test")
APIS = ("fully_shard", "wrapper")
MESHES = ("1d", "hsdp", "2d", "3d")
DEFAULT_WORLD_SIZE = 4
DEFAULT_STEPS = 3


class EngineUnavailable(RuntimeError):
    """``reffsdp.testing.parity_suite`` does not provide what the command line needs."""


def engine() -> ModuleType:
    """The parity-suite engine module, checked for the names this command line calls."""
    from . import parity_suite

    missing = [name for name in ENGINE_NAMES if not hasattr(parity_suite, name)]
    if missing:
        raise EngineUnavailable(
            "engine not available: reffsdp.testing.parity_suite does not define "
            f"{', '.join(missing)}; install a reffsdp whose parity suite provides them"
        )
    return parity_suite


# --- arguments ----------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _program_name() -> str:
    """``reffsdp-parity`` when run as the console script, else the ``-m`` form."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("reffsdp-parity") else "python -m reffsdp.testing"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_program_name(),
        description="Train reffsdp-sharded models next to DDP and check they agree.",
        epilog="Filters combine: a scenario runs when it matches every kind of filter given.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="print the selected scenario names")
    what.add_argument(
        "--self-test",
        action="store_true",
        help="plant known bugs and check that the suite catches every one",
    )
    select = parser.add_argument_group("selecting scenarios (each repeatable)")
    select.add_argument(
        "--only", action="append", default=[], metavar="GLOB", help="names matching GLOB"
    )
    select.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="not names matching GLOB"
    )
    select.add_argument("--api", action="append", default=[], choices=APIS)
    select.add_argument("--mesh", action="append", default=[], choices=MESHES)
    run = parser.add_argument_group("how to run")
    run.add_argument(
        "--backend",
        choices=("threaded", "gloo", "nccl"),
        default="threaded",
        help="threaded: one thread per rank (default); gloo (CPU) or nccl (CUDA): one process "
        "per rank",
    )
    run.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="for the threaded backend (default cpu); gloo runs on cpu, nccl on cuda",
    )
    run.add_argument(
        "--world-size",
        type=_positive_int,
        default=DEFAULT_WORLD_SIZE,
        metavar="N",
        help=f"ranks per scenario (default {DEFAULT_WORLD_SIZE}); threaded worlds grow for "
        "scenarios that need more, process backends skip them",
    )
    run.add_argument(
        "--steps",
        type=_positive_int,
        default=DEFAULT_STEPS,
        metavar="N",
        help=f"training steps per scenario (default {DEFAULT_STEPS})",
    )
    run.add_argument("--seed", type=int, default=0, metavar="N", help="seed for models and inputs")
    out = parser.add_argument_group("outputs")
    out.add_argument("--json", metavar="FILE", help="write results and run metadata as JSON")
    out.add_argument("--junit-xml", metavar="FILE", help="write JUnit XML (for CI)")
    return parser


def _unique(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse combinations that cannot run here (``parser.error`` exits with status 2)."""
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    if args.backend == "gloo" and args.device != "cpu":
        parser.error("--backend gloo runs on CPU; use --backend nccl or threaded for CUDA")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl runs on CUDA; use --backend gloo or threaded for CPU")
    if args.device == "cuda" and not torch.cuda.is_available():
        what = "--backend nccl" if args.backend == "nccl" else "--device cuda"
        parser.error(f"{what} needs CUDA, which is not available on this machine")
    if args.backend == "nccl" and torch.cuda.device_count() < args.world_size:
        parser.error(
            f"--backend nccl runs one process per GPU: --world-size {args.world_size} needs "
            f"{args.world_size} GPUs, this machine has {torch.cuda.device_count()}; pass "
            "--world-size with at most that many (or use --backend threaded --device cuda)"
        )
    for flag, path in (("--json", args.json), ("--junit-xml", args.junit_xml)):
        if path is not None and os.path.isdir(path):
            parser.error(f"{flag} {path}: is a directory; give a file name")


def suite_options(engine_module: ModuleType, args: argparse.Namespace) -> Any:
    return engine_module.SuiteOptions(
        backend=args.backend,
        device=args.device,
        world_size=args.world_size,
        api=_unique(args.api),
        mesh=_unique(args.mesh),
        only=_unique(args.only),
        exclude=_unique(args.exclude),
        steps=args.steps,
        seed=args.seed,
    )


def _describe_filters(args: argparse.Namespace) -> str:
    given = [
        f"--{flag.replace('_', '-')} {value}"
        for flag in ("api", "mesh", "only", "exclude")
        for value in getattr(args, flag)
    ]
    return " ".join(given)


# --- live output --------------------------------------------------------------------------


class Progress:
    """Prints a line per finished item; on a terminal, keeps a progress bar below them.

    ``on_result`` may be called from any thread; a lock keeps lines whole. The bar is
    redrawn twice a second by a daemon thread so its clock moves between results.
    """

    def __init__(self, stream: TextIO, total: int | None, start: float) -> None:
        self.stream = stream
        self.total = total
        self.start = start
        self.done = 0
        self.show_bar = total is not None and _is_terminal(stream)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.show_bar:
            self._draw_bar()
            self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            self._clear_bar()
            self.stream.flush()

    def add(self, text: str) -> None:
        """Print ``text`` (one finished item) above the bar."""
        with self._lock:
            self.done += 1
            self._clear_bar()
            self.stream.write(text + "\n")
            self._draw_bar()
            self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                self._clear_bar()
                self._draw_bar()
                self.stream.flush()

    def _clear_bar(self) -> None:
        if self.show_bar:
            self.stream.write("\r\x1b[K")

    def _draw_bar(self) -> None:
        if self.show_bar:
            assert self.total is not None
            elapsed = time.perf_counter() - self.start
            self.stream.write(report.progress_bar(self.done, self.total, elapsed))


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


# --- running ------------------------------------------------------------------------------


def _reffsdp_version() -> str:
    try:
        return importlib.metadata.version("reffsdp")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def run_info(
    args: argparse.Namespace, started: datetime.datetime, seconds: float
) -> report.RunInfo:
    return report.RunInfo(
        torch_version=torch.__version__,
        reffsdp_version=_reffsdp_version(),
        python_version=platform.python_version(),
        device=args.device,
        device_name=_device_name(args.device),
        backend=args.backend,
        world_size=args.world_size,
        seed=args.seed,
        steps=args.steps,
        started=started.isoformat(timespec="seconds"),
        seconds=round(seconds, 3),
        filters={
            flag: list(_unique(getattr(args, flag))) for flag in ("api", "mesh", "only", "exclude")
        },
    )


def _write(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "wb") as file:
        file.write(data)


def _run_collecting(
    run: Callable[..., Any], options: Any, progress: Progress, line: Callable[[int, Any], str]
) -> tuple[list[Any], str | None]:
    """Run the engine, printing each result as it arrives; return results and any crash.

    Results are collected from ``on_result``, so that a crash part-way still leaves the
    finished scenarios for the table and the report files.
    """
    results: list[Any] = []

    def on_result(result: Any) -> None:
        results.append(result)
        progress.add(line(len(results), result))

    try:
        with progress:
            returned = run(options, on_result=on_result)
            seen = {id(result) for result in results}
            for result in returned or ():  # any the engine did not report as it went
                if id(result) not in seen:
                    on_result(result)
    except Exception:  # noqa: BLE001 - reported with the partial results, then exit 1
        return results, traceback.format_exc()
    return results, None


def _finish(
    args: argparse.Namespace,
    started: datetime.datetime,
    start: float,
    results: list[Any],
    error: str | None,
    *,
    self_test: bool,
) -> None:
    """Write the requested report files."""
    info = run_info(args, started, time.perf_counter() - start)
    if args.json:
        to_json = report.self_test_json if self_test else report.suite_json
        text = json.dumps(to_json(info, results, error), indent=2) + "\n"
        _write(args.json, text.encode())
    if args.junit_xml:
        to_junit = report.self_test_junit if self_test else report.suite_junit
        _write(args.junit_xml, report.junit_bytes(to_junit(info, results, error)))


def run_suite(engine_module: ModuleType, args: argparse.Namespace, options: Any, total: int) -> int:
    started = datetime.datetime.now(datetime.timezone.utc)
    start = time.perf_counter()
    print(
        f"reffsdp parity suite: {total} scenarios, {args.backend} backend on {args.device}, "
        f"world size {args.world_size}, {args.steps} steps, seed {args.seed}",
        flush=True,
    )
    progress = Progress(sys.stdout, total, start)
    line = lambda index, result: report.progress_line(index, total, result)
    results, error = _run_collecting(engine_module.run_suite, options, progress, line)
    seconds = time.perf_counter() - start
    if results:
        print()
        print(report.format_table(results))
    for section in (report.format_skips(results), report.format_failures(results)):
        if section:
            print()
            print(section)
    if error is not None:
        print(f"\nthe parity suite stopped with an error:\n{error}", file=sys.stderr)
    print()
    print(report.summary_line(results, seconds), flush=True)
    _finish(args, started, start, results, error, self_test=False)
    failed = report.summarize(results)["failed"]
    return 1 if failed or error is not None else 0


def run_self_test(engine_module: ModuleType, args: argparse.Namespace, options: Any) -> int:
    started = datetime.datetime.now(datetime.timezone.utc)
    start = time.perf_counter()
    print("reffsdp parity suite self-test: planting known bugs, one at a time", flush=True)
    progress = Progress(sys.stdout, None, start)
    results, error = _run_collecting(
        engine_module.run_self_test, options, progress, report.self_test_line
    )
    if error is not None:
        print(f"\nthe self-test stopped with an error:\n{error}", file=sys.stderr)
    print()
    print(report.self_test_summary(results, time.perf_counter() - start), flush=True)
    if not results and error is None:
        print("no planted bug ran: the filters left none", file=sys.stderr)
    _finish(args, started, start, results, error, self_test=True)
    all_caught = bool(results) and all(result.caught for result in results)
    return 0 if all_caught and error is None else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if hasattr(sys.stdout, "reconfigure"):  # the table's Δ on a terminal that lacks it
        sys.stdout.reconfigure(errors="replace")
    try:
        engine_module = engine()
    except EngineUnavailable as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 1
    options = suite_options(engine_module, args)
    if args.self_test:
        return run_self_test(engine_module, args, options)
    scenarios = engine_module.list_scenarios(options)
    if not scenarios:
        where = f"the {args.backend} backend at world size {args.world_size}"
        if any(getattr(args, flag) for flag in ("api", "mesh", "only", "exclude")):
            parser.error(
                f"no scenario matches {_describe_filters(args)} on {where}; "
                "--list without filters shows every name"
            )
        parser.error(f"the parity suite has no scenario for {where}")
    if args.list:
        for scenario in scenarios:
            print(scenario.name)
        print(f"{len(scenarios)} scenarios", file=sys.stderr)
        return 0
    return run_suite(engine_module, args, options, len(scenarios))


if __name__ == "__main__":
    sys.exit(main())
