"""``python -m reffsdp.testing`` (installed as ``reffsdp-parity``): run the parity suite.

The suite trains sharded models next to ``DistributedDataParallel`` and checks that
losses, gradients, parameters and the collectives issued agree, scenario by scenario
(:mod:`reffsdp.testing.parity_suite` runs them). The FSDP that shards is reffsdp, or the
implementation ``--impl`` names (:mod:`reffsdp.testing.impls`). This module is the command
line around it::

    python -m reffsdp.testing                                # threaded ranks on CPU
    python -m reffsdp.testing --list --mesh hsdp             # names, nothing runs
    python -m reffsdp.testing --api wrapper --only '*/bf16/*' --json out.json
    python -m reffsdp.testing --backend nccl --world-size 1 --junit-xml parity.xml
    python -m reffsdp.testing --impl torch --backend gloo    # torch's own FSDP
    python -m reffsdp.testing --self-test                    # are planted bugs caught?
    torchrun --nproc-per-node 4 -m reffsdp.testing           # joins torchrun's (or srun's) world

Under a launcher (torchrun, srun) every rank runs this command: it joins the launched
world instead of starting ranks (:mod:`reffsdp.testing.launch` decides), every rank selects
the same scenarios, and rank 0 alone prints and writes the reports.

The exit status is 0 when every scenario passed or was skipped, but not when every one was
skipped unless ``--allow-skips`` is given, nor when the implementation refused some
(unsupported) unless ``--allow-unsupported`` is given (for ``--self-test``: when every
planted bug was caught), 1 otherwise, 2 for bad arguments (an unwritable report path and an
``--impl`` that cannot be loaded included), 130 when interrupted (Ctrl-C): the reports are
then written with the scenarios that finished.
Formatting lives in :mod:`reffsdp.testing.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any, TextIO

import pytest
import rich.progress
import torch
from rich.console import Console

from . import parity_plugin, report
from .impls import DEFAULT, Implementation, ImplementationError, load_implementation
from .launched_world import LaunchedEnv, LaunchError, read_launched_env

# What this command line uses of the engine, reffsdp.testing.parity_suite.
ENGINE_NAMES = (
    "SuiteOptions",
    "list_scenarios",
    "iter_suite",
    "list_self_test",
    "iter_self_test",
)
APIS = ("fully_shard", "wrapper", "naive")  # naive: reffsdp.naive, a suite scenario only
MESHES = ("1d", "hsdp", "2d", "3d")
DEFAULT_WORLD_SIZE = 4
DEFAULT_STEPS = 3
DEFAULT_TIMEOUT_S = 300.0
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


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
        description="Train sharded models (reffsdp's, or those of the FSDP implementation "
        "--impl names) next to DDP and check they agree.",
        epilog="Filters combine: a scenario runs when it matches every kind of filter given. "
        "Unsupported: the implementation refused to set the scenario up (it raised while "
        "sharding or configuring the model); its message is shown, and it fails the run "
        "unless --allow-unsupported. Not applicable: a scenario of an API the implementation "
        "does not export (or of reffsdp's own NaiveFSDP).",
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
    _add_run_options(parser.add_argument_group("how to run"))
    out = parser.add_argument_group("outputs")
    out.add_argument("--json", metavar="FILE", help="write results and run metadata as JSON")
    out.add_argument("--junit-xml", metavar="FILE", help="write JUnit XML (for CI)")
    return parser


def _add_run_options(run: argparse._ArgumentGroup) -> None:
    run.add_argument(
        "--impl",
        default=DEFAULT,
        metavar="NAME",
        help="the FSDP implementation to check: reffsdp (default), torch "
        "(torch.distributed.fsdp as installed) or the dotted path of an importable module "
        "that exports torch.distributed.fsdp's names (fully_shard and/or "
        "FullyShardedDataParallel, ...)",
    )
    run.add_argument(
        "--backend",
        choices=("threaded", "gloo", "nccl"),
        default=None,
        help="threaded: one thread per rank (default); gloo (CPU) or nccl (CUDA): one process "
        "per rank (under torchrun or srun: nccl where CUDA is present, else gloo)",
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
        default=None,
        metavar="N",
        help=f"ranks per scenario (default {DEFAULT_WORLD_SIZE}, or the launched world's); "
        "threaded worlds grow for scenarios that need more, process backends skip them",
    )
    run.add_argument(
        "--steps",
        type=_positive_int,
        default=DEFAULT_STEPS,
        metavar="N",
        help=f"training steps per scenario (default {DEFAULT_STEPS})",
    )
    run.add_argument("--seed", type=int, default=0, metavar="N", help="seed for models and inputs")
    run.add_argument(
        "--timeout",
        type=_positive_int,
        default=int(DEFAULT_TIMEOUT_S),
        metavar="SECONDS",
        help=f"per scenario (default {DEFAULT_TIMEOUT_S:g}); collectives time out with it",
    )
    run.add_argument(
        "--allow-skips",
        action="store_true",
        help="exit 0 when every selected scenario was skipped (default: that is a failure)",
    )
    run.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="exit 0 when the implementation refused some scenarios (unsupported) and "
        "nothing failed (default: that is a failure)",
    )


def _unique(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse combinations that cannot run here (``parser.error`` exits with status 2)."""
    try:
        args.launched = read_launched_env()
    except LaunchError as error:
        parser.error(str(error))
    if args.launched is not None:
        _join_launched(parser, args, args.launched)
    if args.backend is None:
        args.backend = "threaded"
    if args.world_size is None:
        args.world_size = DEFAULT_WORLD_SIZE
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    try:
        args.implementation = load_implementation(args.impl)
    except ImplementationError as error:
        parser.error(f"--impl {args.impl}: {error}")
    if args.self_test and "naive" in args.api:
        parser.error("--self-test plants bugs in fully_shard and the wrapper; --api naive has none")
    if args.backend == "gloo" and args.device != "cpu":
        parser.error("--backend gloo runs on CPU; use --backend nccl or threaded for CUDA")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl runs on CUDA; use --backend gloo or threaded for CPU")
    if args.device == "cuda" and not torch.cuda.is_available():
        what = "--backend nccl" if args.backend == "nccl" else "--device cuda"
        parser.error(f"{what} needs CUDA, which is not available on this machine")
    if args.launched is not None and args.backend == "nccl":
        _check_gpus_per_node(parser, args.launched)
    elif args.backend == "nccl" and torch.cuda.device_count() < args.world_size:
        parser.error(
            f"--backend nccl runs one process per GPU: --world-size {args.world_size} needs "
            f"{args.world_size} GPUs, this machine has {torch.cuda.device_count()}; pass "
            "--world-size with at most that many (or use --backend threaded --device cuda)"
        )
    if not args.list and _reports(args):
        for flag, path in (("--json", args.json), ("--junit-xml", args.junit_xml)):
            problem = None if path is None else _unwritable(path)
            if problem:
                parser.error(f"{flag} {path}: {problem}; give a file name you can write")


def _join_launched(
    parser: argparse.ArgumentParser, args: argparse.Namespace, launched: LaunchedEnv
) -> None:
    """Take backend and world size from the launched world; a different one given is a
    usage error naming both."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    where = f"{launched.launcher} launched {launched.world_size} ranks"
    if args.backend not in (None, backend):
        parser.error(
            f"--backend {args.backend} conflicts with the launched world: {where}, which "
            f"runs on {backend} here; drop --backend"
        )
    if args.world_size not in (None, launched.world_size):
        parser.error(
            f"--world-size {args.world_size} conflicts with the launched world: {where}; "
            "drop --world-size (or launch that many ranks)"
        )
    args.backend, args.world_size = backend, launched.world_size


def _check_gpus_per_node(parser: argparse.ArgumentParser, launched: LaunchedEnv) -> None:
    gpus = torch.cuda.device_count()
    if gpus < launched.local_world_size:
        parser.error(
            f"{launched.launcher} put {launched.local_world_size} ranks on this node, which "
            f"has {gpus} GPUs; nccl runs one rank per GPU: launch at most {gpus} per node"
        )


def _reports(args: argparse.Namespace) -> bool:
    """Whether this process prints and writes the reports: rank 0 of a launched world."""
    return args.launched is None or args.launched.rank == 0


def _unwritable(path: str) -> str | None:
    """Why a report cannot be written at ``path`` (``None`` when it can).

    Opens the file for appending, creating missing folders (as writing the report does), so
    a run never ends in a traceback over a path it could have refused at the start.
    """
    if os.path.isdir(path):
        return "is a directory"
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as error:
        return error.strerror or str(error)
    return None


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
        nodes=1 if args.launched is None else args.launched.nodes,
        timeout_s=float(args.timeout),
        impl=args.impl,
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

    The bar is ``rich``'s, drawn only on a terminal and gone once the run ends; elsewhere
    (a file, a pipe) only the lines are written.
    """

    def __init__(self, stream: TextIO, total: int | None) -> None:
        self.console = Console(file=stream, highlight=False, markup=False, emoji=False)
        self.bar = rich.progress.Progress(
            rich.progress.BarColumn(),
            rich.progress.MofNCompleteColumn(),
            rich.progress.TimeElapsedColumn(),
            console=self.console,
            transient=True,
            disable=total is None or not _is_terminal(stream),
        )
        self.task = self.bar.add_task("scenarios", total=total)

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.bar.stop()

    def begin(self, text: str, total: int | None) -> None:
        """Print ``text`` (what the run holds, once known) and set the bar's ``total``."""
        self.console.print(text, soft_wrap=True)
        self.bar.update(self.task, total=total)

    def add(self, text: str) -> None:
        """Print ``text`` (one finished item) above the bar."""
        self.console.print(text, soft_wrap=True)
        self.bar.advance(self.task)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _table_width(stream: TextIO) -> int | None:
    """The terminal's width, or ``None`` for a file or a pipe (tables stay whole there)."""
    return shutil.get_terminal_size().columns if _is_terminal(stream) else None


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
        impl=args.impl,
        impl_version=args.implementation.version,
        python_version=platform.python_version(),
        device=args.device,
        device_name=_device_name(args.device),
        backend=args.backend,
        world_size=args.world_size,
        **_launch_fields(args),
        seed=args.seed,
        steps=args.steps,
        started=started.isoformat(timespec="seconds"),
        seconds=round(seconds, 3),
        filters={
            flag: list(_unique(getattr(args, flag))) for flag in ("api", "mesh", "only", "exclude")
        },
    )


def _launch_fields(args: argparse.Namespace) -> dict[str, Any]:
    """How the ranks came to be: ``launcher`` (spawn: this command started them), nodes
    and ranks per node."""
    launched = args.launched
    if launched is None:
        return {"launcher": "spawn", "nodes": 1, "ranks_per_node": args.world_size}
    nodes, per_node = launched.nodes, launched.local_world_size
    return {"launcher": launched.launcher, "nodes": nodes, "ranks_per_node": per_node}


def _write(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "wb") as file:
        file.write(data)


def _count(number: int, noun: str) -> str:
    """``1 scenario``, ``2 scenarios``."""
    return f"{number} {noun}" + ("" if number == 1 else "s")


# --- pytest runs the tests ----------------------------------------------------------------

# Why pytest.main needs these arguments: the run is this module's and nothing else's.
_PYTEST_ISOLATION = (
    *("-c", os.devnull),  # no pytest.ini / pyproject / tox.ini of the folder it runs in
    "--noconftest",  # nor their conftest.py files
    *("-p", "no:cacheprovider"),  # no .pytest_cache left behind
    *("-p", "no:terminal"),  # this command prints its own lines and table
    "--capture=sys",  # a test's output goes to JUnit; the progress bar to the terminal
    *("-W", "ignore::pytest.PytestExperimentalApiWarning"),  # record_xml_attribute
    *("-o", "junit_family=xunit1"),  # whose testcases take the attributes the tests set
    *("-o", "junit_logging=system-out"),  # a scenario's numbers, which its test prints
)


def pytest_argv(test: str, args: argparse.Namespace) -> list[str]:
    """``pytest.main``'s arguments to run ``test`` of :mod:`reffsdp.testing.parity_tests`,
    then the user's own after ``--``."""
    module = parity_plugin.MODULE_PATH
    suite = "reffsdp-parity-self-test" if test == parity_plugin.SELF_TEST else "reffsdp-parity"
    argv = [f"{module}::{test}", "--rootdir", str(module.parent), *_PYTEST_ISOLATION]
    argv += ["-o", f"junit_suite_name={suite}"]
    if args.junit_xml:
        argv += ["--junit-xml", args.junit_xml]
    if args.list:
        argv.append("--collect-only")
    return [*argv, *args.pytest_args]


def run_pytest(plugin: parity_plugin.ParityPlugin, args: argparse.Namespace) -> int:
    """Run the cases of ``plugin``'s test; pytest's exit code."""
    with pytest.MonkeyPatch.context() as environment:
        # No PYTEST_ADDOPTS, and no plugins pytest would load from the environment (a
        # user's pytest-xdist or pytest-cov), for the length of the run.
        environment.delenv("PYTEST_ADDOPTS", raising=False)
        environment.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        return int(pytest.main(pytest_argv(plugin.test, args), plugins=[plugin]))


def list_tests(engine_module: ModuleType, args: argparse.Namespace, options: Any) -> int:
    """``--list``: the names pytest collects (after the user's pytest arguments too)."""
    plugin = parity_plugin.ParityPlugin(parity_plugin.SCENARIO_TEST, engine_module, options)
    code = run_pytest(plugin, args)
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        return _pytest_trouble(code, plugin)
    for name in plugin.selected:
        print(name)
    sys.stdout.flush()
    print(_listed(args.implementation, options, plugin.selected), file=sys.stderr)
    return 0


def _listed(impl: Implementation, options: Any, selected: Sequence[str]) -> str:
    """``66 scenarios`` (of reffsdp), or ``66 scenarios of torch 2.13.0, 2 not
    applicable: ...`` for another implementation."""
    text = _count(len(selected), "scenario")
    if impl.name == DEFAULT:
        return text
    apis = {info.name: info.api for info in engine().list_scenarios(options)}
    reasons = dict.fromkeys(impl.not_applicable(apis[name]) for name in selected)
    reasons.pop("", None)
    missing = sum(bool(impl.not_applicable(apis[name])) for name in selected)
    text += f" of {impl.label}"
    if missing:
        text += f", {missing} not applicable: " + "; ".join(reasons)
    return text


def _pytest_trouble(code: int, plugin: parity_plugin.ParityPlugin) -> int:
    """The exit status when pytest itself refused or failed (it printed why on stderr)."""
    if code == pytest.ExitCode.USAGE_ERROR:
        return 2
    if plugin.error is not None:
        print(f"\nthe parity suite stopped with an error:\n{plugin.error}", file=sys.stderr)
    return 1


def run_tests(
    engine_module: ModuleType, args: argparse.Namespace, options: Any, *, self_test: bool
) -> int:
    """Run the scenarios (or ``--self-test``'s planted bugs) under pytest, print the lines,
    the table and the summary, write the JSON; the exit status."""
    started = datetime.datetime.now(datetime.timezone.utc)
    start = time.perf_counter()
    progress = Progress(sys.stdout, None if self_test else 0)
    test = parity_plugin.SELF_TEST if self_test else parity_plugin.SCENARIO_TEST
    plugin = parity_plugin.ParityPlugin(
        test,
        engine_module,
        options,
        on_collected=lambda count: progress.begin(
            _header(args, None if self_test else count), None if self_test else count
        ),
        on_result=lambda index, result: progress.add(
            _line(index, len(plugin.selected), result, self_test)
        ),
        properties=report.junit_properties(run_info(args, started, 0.0)),
    )
    with progress:
        code = run_pytest(plugin, args)
    seconds = time.perf_counter() - start
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR):
        return _pytest_trouble(code, plugin)
    if self_test:
        _print_self_test(plugin, seconds)
    else:
        _print_suite(args, plugin, seconds)
    _write_json(args, run_info(args, started, seconds), plugin, self_test=self_test)
    return _exit_status(args, plugin, code, self_test=self_test)


def _header(args: argparse.Namespace, total: int | None) -> str:
    """The first line: what runs (``total`` scenarios; ``None``: the self-test)."""
    if total is None:
        return "reffsdp parity suite self-test: planting known bugs, one at a time"
    return (
        f"reffsdp parity suite: {_count(total, 'scenario')}{_checking(args)}, {args.backend} "
        f"backend on {args.device}, world size {args.world_size}, "
        f"{_count(args.steps, 'step')}, seed {args.seed}{_launched_by(args)}"
    )


def _checking(args: argparse.Namespace) -> str:
    """``, checking torch 2.13.0``: which FSDP shards, when it is not reffsdp."""
    impl = args.implementation
    return "" if impl.name == DEFAULT else f", checking {impl.label}"


def _line(index: int, total: int, result: Any, self_test: bool) -> str:
    if self_test:
        return report.self_test_line(index, result)
    return report.progress_line(index, total, result)


def _print_suite(
    args: argparse.Namespace, plugin: parity_plugin.ParityPlugin, seconds: float
) -> None:
    results = plugin.results
    if results:
        print()
        print(f"implementation: {args.implementation.label}")
        print(report.format_table(results, _table_width(sys.stdout)))
    for section in (report.format_skips(results), report.format_failures(results)):
        if section:
            print()
            print(section)
    if plugin.error is not None:
        print(f"\nthe parity suite stopped with an error:\n{plugin.error}", file=sys.stderr)
    print()
    print(report.summary_line(results, seconds), flush=True)


def _print_self_test(plugin: parity_plugin.ParityPlugin, seconds: float) -> None:
    if plugin.error is not None:
        print(f"\nthe self-test stopped with an error:\n{plugin.error}", file=sys.stderr)
    print()
    print(report.self_test_summary(plugin.results, seconds), flush=True)


def _write_json(
    args: argparse.Namespace,
    info: report.RunInfo,
    plugin: parity_plugin.ParityPlugin,
    *,
    self_test: bool,
) -> None:
    if args.json:
        to_json = report.self_test_json if self_test else report.suite_json
        document = to_json(info, plugin.results, plugin.error, interrupted=plugin.interrupted)
        _write(args.json, (json.dumps(document, indent=2) + "\n").encode())


def _exit_status(
    args: argparse.Namespace, plugin: parity_plugin.ParityPlugin, code: int, *, self_test: bool
) -> int:
    results = plugin.results
    noun = "planted bug" if self_test else "scenario"
    if plugin.interrupted:
        of = "" if self_test else f" of {len(plugin.selected)}"
        print(f"interrupted after {_count(len(results), noun)}{of}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if not plugin.selected:
        what = "no planted bug ran" if self_test else "no scenario ran"
        given = " ".join(args.pytest_args)
        print(
            f"{what}: the filters left none{f' (pytest: {given})' if given else ''}",
            file=sys.stderr,
        )
        return 1 if self_test else 2  # a selection that leaves nothing is a usage error
    if plugin.error is not None:
        return 1
    if self_test:
        return 0 if results and all(result.caught for result in results) else 1
    counts = report.summarize(results)
    if counts["failed"]:
        return 1
    unsupported = counts.get(report.UNSUPPORTED, 0)
    if unsupported and not args.allow_unsupported:
        print(
            f"{args.implementation.name} refused to set up {_count(unsupported, 'scenario')} "
            "(unsupported, listed above with its message), so they were not checked; pass "
            "--allow-unsupported to accept that (exit status 0)",
            file=sys.stderr,
        )
        return 1
    if not counts["passed"] and not args.allow_skips:
        what = "skipped" if counts["skipped"] == counts["total"] else "skipped, unsupported or n/a"
        print(
            f"every scenario was {what}, so nothing was checked; pass --allow-skips to "
            "accept that (exit status 0)",
            file=sys.stderr,
        )
        return 1
    return 0


def _launched_by(args: argparse.Namespace) -> str:
    launched = args.launched
    if launched is None:
        return ""
    nodes = _count(launched.nodes, "node")
    return f", launched by {launched.launcher}: {nodes} x {launched.local_world_size} ranks"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; its exit status. Ctrl-C ends it with 130 and no traceback; a
    reader that stops reading (``| head``) ends it quietly."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Nobody reads stdout any more: send what is left in its buffer nowhere, so that
        # flushing it at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    own, pytest_args = _split_at_dashes(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(own)
    args.pytest_args = pytest_args
    check_args(parser, args)
    if _reports(args):
        return _run(parser, args)
    args.json = args.junit_xml = None  # rank 0 of the launched world prints and writes
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        return _run(parser, args)


def _split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """This command's arguments, and pytest's (those after ``--``)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # the table's Δ on a terminal that lacks it
        sys.stdout.reconfigure(errors="replace")
    try:
        engine_module = engine()
    except EngineUnavailable as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 1
    options = suite_options(engine_module, args)
    if args.self_test:
        return run_tests(engine_module, args, options, self_test=True)
    if not engine_module.list_scenarios(options):
        where = f"the {args.backend} backend at world size {args.world_size}"
        if any(getattr(args, flag) for flag in ("api", "mesh", "only", "exclude")):
            parser.error(
                f"no scenario matches {_describe_filters(args)} on {where}; "
                "--list without filters shows every name"
            )
        parser.error(f"the parity suite has no scenario for {where}")
    if args.list:
        return list_tests(engine_module, args, options)
    return run_tests(engine_module, args, options, self_test=False)


if __name__ == "__main__":
    sys.exit(main())
