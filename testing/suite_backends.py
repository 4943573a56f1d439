"""Where the parity suite's scenarios run: threaded ranks, or one process per rank.

:func:`iter_results` runs scenarios (see :mod:`reffsdp.testing.suite_scenarios`) with
:func:`~reffsdp.testing.suite_rank.run_scenario` on every rank, and yields rank 0's result
of each as it finishes. Backends: ``threaded`` (one process, a thread per rank; each
scenario gets a world of its own size, so the 8-rank 3-D mesh always runs;
``device="cuda"`` puts every rank on one GPU), ``gloo`` (a process per rank on CPU) and
``nccl`` (a process per GPU). Process backends start their ranks once for the whole run
(:mod:`reffsdp.testing.launch`, which stops them on Ctrl-C: [Note: stopping rank
processes] there), run every scenario on ``world_size`` ranks and skip those whose mesh does
not fit.

A planted bug (see :mod:`reffsdp.testing.self_test`) is a context manager factory that
every rank enters around each scenario; rank processes are handed it by reference. The
implementation under test travels by name (``SuiteOptions.impl``), and each rank loads it
(:func:`reffsdp.testing.impls.load_implementation`); scenarios of an API it lacks are
reported not applicable here, without starting a rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from . import torch_private
from .collective_trace import CollectiveRecorder
from .impls import DEFAULT, load_implementation
from .launch import RankFailed, RankWorld, start_ranks
from .suite_rank import NOT_APPLICABLE, ScenarioResult, run_scenario
from .suite_scenarios import ScenarioSpec

BACKENDS = ("threaded", "gloo", "nccl")
SCENARIO_TIMEOUT_S = 300.0
_FAILURE_WAIT_S = 7.0  # how long rank 0 waits for the other ranks' failures (launched)


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
    backend: str = "threaded"  # "threaded" | "gloo" | "nccl"
    device: str = "cpu"  # "cpu" | "cuda" (threaded backend; gloo=cpu, nccl=cuda)
    world_size: int = 4  # ranks for 1-D/HSDP/2-D; threaded 3-D scenarios get 8
    api: tuple[str, ...] = ()  # subset of SUITE_APIS; () = all
    mesh: tuple[str, ...] = ()  # subset of MESHES; () = all
    only: tuple[str, ...] = ()  # fnmatch globs on scenario names; () = all
    exclude: tuple[str, ...] = ()  # fnmatch globs
    steps: int = 3
    seed: int = 0
    nodes: int = 1  # of a launched world: HSDP replicates across them
    timeout_s: float = SCENARIO_TIMEOUT_S  # per scenario; process groups time out with it
    impl: str = DEFAULT  # the FSDP under test: "reffsdp", "torch" or a module path

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def resizes_worlds(self) -> bool:
        return self.backend == "threaded"

    def device_for(self, rank: int) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", rank)
        if self.backend == "gloo":
            return torch.device("cpu")
        return torch.device(self.device)


@dataclasses.dataclass(frozen=True)
class ScenarioInfo:
    name: str  # unique, e.g. "fully_shard/hsdp/bf16/mlp"
    api: str
    mesh: str
    feature: str
    model: str
    world_size: int  # ranks it runs on under these options


def scenario_info(spec: ScenarioSpec, options: SuiteOptions) -> ScenarioInfo:
    """``spec`` as it runs under ``options``."""
    return ScenarioInfo(
        name=spec.name,
        api=spec.api,
        mesh=spec.mesh,
        feature=spec.feature,
        model=spec.model,
        world_size=spec.world_size(options.world_size, resize=options.resizes_worlds),
    )


def _skipped(
    spec: ScenarioSpec, options: SuiteOptions, reason: str, status: str = "skipped"
) -> ScenarioResult:
    info = scenario_info(spec, options)
    return ScenarioResult(
        **_identity(info), status=status, message=reason, steps=options.steps, seconds=0.0
    )


def _not_run(spec: ScenarioSpec, options: SuiteOptions) -> ScenarioResult | None:
    """The result of a scenario that does not run under ``options`` (an API the
    implementation lacks, a mesh the world cannot hold), else ``None``."""
    reason = load_implementation(options.impl).not_applicable(spec.api)
    if reason:
        return _skipped(spec, options, reason, NOT_APPLICABLE)
    return None


def _identity(info: ScenarioInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "api": info.api,
        "mesh": info.mesh,
        "feature": info.feature,
        "model": info.model,
        "world_size": info.world_size,
    }


BugFactory = Callable[[], AbstractContextManager[Any]]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep expected noise out of the suite's output: the deprecation warnings the
    wrapper's state-dict API repeats from torch's, and DTensor's note that gathering a full
    tensor of a 2-D sharded parameter takes two all-gathers (the full state dicts)."""
    logger = logging.getLogger(torch_private.DTENSOR_REDISTRIBUTE_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def _crashed(
    spec: ScenarioSpec, options: SuiteOptions, message: str, seconds: float, trace: str = ""
) -> ScenarioResult:
    info = scenario_info(spec, options)
    return ScenarioResult(
        **_identity(info),
        status="failed",
        message=message,
        steps=options.steps,
        seconds=seconds,
        traceback=trace,
    )


def run_threaded_one(
    spec: ScenarioSpec, options: SuiteOptions, bug: BugFactory | None = None
) -> ScenarioResult:
    """Run ``spec`` on a threaded world of the ranks it needs; rank 0's result."""
    from .multithread import RankFailure, run_threaded

    not_run = _not_run(spec, options)
    if not_run is not None:
        return not_run

    world_size = spec.world_size(options.world_size, resize=True)
    found: dict[int, ScenarioResult] = {}
    device = options.device_for(0)

    def rank_main(rank: int) -> None:
        found[rank] = run_scenario(
            spec,
            device,
            steps=options.steps,
            seed=options.seed,
            world_size=world_size,
            impl=options.impl,
        )

    start = time.perf_counter()
    try:
        with _quiet(), bug() if bug is not None else nullcontext():
            run_threaded(rank_main, world_size, timeout_s=options.timeout_s)
    except RankFailure as failure:
        message = "error: " + _rank_error(failure)
        return _crashed(spec, options, message, time.perf_counter() - start, str(failure))
    return found[0]


def _rank_error(failure: Any) -> str:
    """The whole exception (type and every line of its message) of the lowest rank that
    failed on its own, not as a consequence of another rank's failure."""
    from .multithread import RankStopped
    from .threaded_pg import CollectiveAborted

    for rank in sorted(failure.failures):
        error = failure.failures[rank]
        if not isinstance(error, (CollectiveAborted, RankStopped)):
            return _exception_text(error)
    return _last_exception(str(failure))


def _exception_text(error: BaseException) -> str:
    """``"RuntimeError: <the whole message>"``, as a traceback ends."""
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _last_exception(text: str) -> str:
    """The exception that ends a formatted traceback, every line of its message (or
    ``text`` itself when it holds no traceback)::

        >>> print(_last_exception('''Traceback (most recent call last):
        ...   File "x.py", line 1, in <module>
        ...     load()
        ... RuntimeError: Error(s) in loading state_dict:
        ... Missing key(s): "w".'''))
        RuntimeError: Error(s) in loading state_dict:
        Missing key(s): "w".
    """
    lines = text.strip().splitlines()
    frames = [index for index, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return text.strip()
    rest = lines[frames[-1] + 1 :]
    while rest and rest[0].startswith("    "):  # the frame's source line and its markers
        rest.pop(0)
    return "\n".join(rest).strip() or text.strip()


def _iter_threaded(
    specs: Sequence[ScenarioSpec], options: SuiteOptions, bug: BugFactory | None = None
) -> Iterator[ScenarioResult]:
    for spec in specs:
        not_run = _not_run(spec, options)
        if not_run is not None:
            yield not_run
            continue
        reason = spec.fits(spec.world_size(options.world_size, resize=True))
        if reason:
            yield _skipped(spec, options, reason)
            continue
        if options.device == "cuda" and not torch.cuda.is_available():
            yield _skipped(spec, options, "no CUDA device")
            continue
        yield run_threaded_one(spec, options, bug)


def _suite_rank(
    world: RankWorld,
    channel: Connection,
    options: SuiteOptions,
    specs: list[ScenarioSpec],
    bug: BugFactory | None,
) -> None:
    """A rank: run every scenario in turn; the rank that reports sends each result (rank 0
    of spawned ranks, every joined rank to its own process: [Note: two ways to be a rank])."""
    if options.backend == "nccl":
        torch.cuda.set_device(world.local_rank)
    recorder = _record_collectives(world)
    world.init_process_group(options.backend, timedelta(seconds=options.timeout_s))
    try:
        broken = ""
        for spec in specs:
            if broken:
                result = _crashed(spec, options, broken, 0.0)
            else:
                result, crashed = _run_on_rank(world, spec, options, bug, recorder)
                if crashed:
                    broken = f"not run: scenario {spec.name} left the ranks out of step"
            if world.rank == 0 or world.joined:
                channel.send(result.to_dict())
    finally:
        dist.destroy_process_group()


def _run_on_rank(
    world: RankWorld,
    spec: ScenarioSpec,
    options: SuiteOptions,
    bug: BugFactory | None,
    recorder: CollectiveRecorder | None,
) -> tuple[ScenarioResult, bool]:
    """One scenario on this rank, and whether it crashed (a failed result naming every rank
    that failed: the ranks are out of step)."""
    start = time.perf_counter()
    try:
        with _quiet(), bug() if bug is not None else nullcontext():
            result = run_scenario(
                spec,
                options.device_for(world.local_rank),
                steps=options.steps,
                seed=options.seed,
                world_size=world.world_size,
                nodes=options.nodes,
                impl=options.impl,
            )
        dist.barrier()
        return result, False
    except Exception as error:  # noqa: BLE001 - reported; the ranks are out of step
        trace = traceback.format_exc()
        message = _crash_message(world, _exception_text(error), recorder)
        return _crashed(spec, options, message, time.perf_counter() - start, trace), True


def _record_collectives(world: RankWorld) -> CollectiveRecorder | None:
    """A joined rank names its last collective when it fails (its launcher is not there to
    watch it); see [Note: failures in a launched world]."""
    if not world.joined:
        return None
    recorder = CollectiveRecorder(None)
    recorder.install()
    return recorder


def _crash_message(world: RankWorld, own: str, recorder: CollectiveRecorder | None) -> str:
    """``"error: <own>"``; in a launched world, every rank's failure, each named, causes
    first (rank 0 waits a little for the others to post theirs)."""
    if recorder is not None and recorder.last is not None:
        own += f"\n  (its last collective: {recorder.last.describe()})"
    world.post_failure(own)
    failures = world.failures(_FAILURE_WAIT_S)
    if not failures:
        return f"error: {own}"
    return "error: " + "\n".join(f"rank {rank}: {text}" for rank, text in failures.items())


def _iter_processes(
    specs: Sequence[ScenarioSpec], options: SuiteOptions, bug: BugFactory | None = None
) -> Iterator[ScenarioResult]:
    world_size = options.world_size
    runnable = []
    for spec in specs:
        not_run = _not_run(spec, options)
        if not_run is not None:
            yield not_run
            continue
        reason = spec.fits(world_size, nodes=options.nodes)
        gpus = torch.cuda.device_count() if options.backend == "nccl" else 0
        if not reason and options.backend == "nccl" and gpus < options.ranks_per_node:
            reason = f"nccl needs {options.ranks_per_node} GPUs per node, found {gpus}"
        if reason:
            yield _skipped(spec, options, reason)
        else:
            runnable.append(spec)
    if not runnable:
        return
    seen = 0
    with start_ranks(_suite_rank, world_size, (options, runnable, bug), name="parity") as ranks:
        try:
            for _, item in ranks.messages():  # the reporting rank's results
                seen += 1
                yield ScenarioResult(**item)
        except RankFailed as failure:  # a rank died: report what never ran
            detail = _last_exception(failure.detail)
            message = f"error: rank {failure.rank} failed: {detail}"
            for spec in runnable[seen:]:
                yield _crashed(spec, options, message, 0.0, str(failure))
            return
    for spec in runnable[seen:]:
        yield _crashed(spec, options, "error: the rank processes ended early", 0.0)


def iter_results(
    specs: Sequence[ScenarioSpec], options: SuiteOptions, bug: BugFactory | None = None
) -> Iterator[ScenarioResult]:
    """Run ``specs`` on ``options.backend``, with ``bug`` planted when given; yields each
    result as it finishes."""
    if options.backend == "threaded":
        return _iter_threaded(specs, options, bug)
    return _iter_processes(specs, options, bug)
