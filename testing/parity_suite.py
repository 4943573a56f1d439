"""The parity suite: sharded training against ``DistributedDataParallel``, scenario by scenario.

Each scenario (see :mod:`reffsdp.testing.suite_scenarios` for the matrix) builds a model,
copies it for the DDP reference, shards the original with ``fully_shard`` or the
``FullyShardedDataParallel`` wrapper, and trains both with
:func:`~reffsdp.testing.parity.check_train_parity` (losses, gradients and parameters
compared at every step). Meanwhile every all-gather, reduce-scatter and all-reduce reffsdp
issues is counted and sized (see [Note: bytes sent per rank] in
:mod:`reffsdp.testing.expected_comms`). A scenario passes when the numbers agree AND the
collectives per step equal the expected counts AND the bytes sent equal the analytic
minimum::

    from reffsdp.testing.parity_suite import SuiteOptions, run_suite
    results = run_suite(SuiteOptions(backend="threaded", mesh=("1d",)))

Backends: ``threaded`` (one process, a thread per rank; each scenario gets a world of its
own size, so the 8-rank 3-D mesh always runs; ``device="cuda"`` puts every rank on one GPU),
``gloo`` (a process per rank on CPU) and ``nccl`` (a process per GPU). Process backends run
every scenario on ``world_size`` ranks and skip those whose mesh does not fit; their rank
processes come from :mod:`reffsdp.testing.launch`, which stops them on Ctrl-C (see [Note:
stopping rank processes] there).

[Note: why the engine counts through the comms seam]
A ``CommCounter`` would also count DDP's all-reduces, the parity check's own verdict
all-reduces and DTensor's tensor-parallel collectives, none of which FSDP issued. The
engine observes reffsdp's single collective seam (:mod:`reffsdp.core.comms`) instead, for
the length of training only (state-dict saving and loading are not a training step).

[Note: a failure on another rank]
``check_train_parity`` fails on every rank together (see [Note: ranks agree on the
verdict] in :mod:`reffsdp.testing.parity`), but only the ranks that saw a mismatch say what
it was: the others' message is one line naming the failing ranks, and each rank's
differences are its own. A result is read on rank 0, so after a failed check every rank
all-gathers its message and differences (:func:`_gather_failures`): the result's message
holds every failing rank's mismatches, and its differences are the largest any rank saw.
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
from fractions import Fraction
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from .expected_comms import CommTally, expected_per_step
from .launch import RankFailed, RankWorld, spawn_ranks
from .parity import ParityDiffs, check_train_parity
from .patching import observe_collectives
from .preflight import check_block_types
from .suite_scenarios import (
    APIS,
    CUSTOM_FEATURES,
    CUSTOM_OPTIONAL_FEATURES,
    FEATURES,
    MESHES,
    WRAPPER_MESHES,
    BuiltScenario,
    CustomModel,
    ScenarioSpec,
    all_specs,
    build_scenario,
    select,
)
from .tolerances import Tolerance

BACKENDS = ("threaded", "gloo", "nccl")
_SCENARIO_TIMEOUT_S = 300.0


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


@dataclasses.dataclass
class ScenarioResult:
    name: str
    api: str
    mesh: str
    feature: str
    model: str
    status: str  # "passed" | "failed" | "skipped"
    message: str  # failure text or skip reason ("" when passed)
    world_size: int
    steps: int
    max_loss_diff: float | None = None
    max_grad_diff: float | None = None
    max_param_diff: float | None = None
    atol: float | None = None
    rtol: float | None = None
    counts: dict[str, float] = dataclasses.field(default_factory=dict)  # per step
    expected_counts: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_per_step: int | None = None  # bytes sent per rank per step, measured
    min_bytes_per_step: int | None = None  # the analytic minimum
    losses: list[float] = dataclasses.field(default_factory=list)  # rank 0's, per step
    seconds: float = 0.0
    traceback: str = ""  # of the exception that failed the scenario ("" when none did)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _info(spec: ScenarioSpec, options: SuiteOptions) -> ScenarioInfo:
    return ScenarioInfo(
        name=spec.name,
        api=spec.api,
        mesh=spec.mesh,
        feature=spec.feature,
        model=spec.model,
        world_size=spec.world_size(options.world_size, resize=options.resizes_worlds),
    )


def _selected(options: SuiteOptions) -> list[ScenarioSpec]:
    return select(
        all_specs(),
        api=options.api,
        mesh=options.mesh,
        only=options.only,
        exclude=options.exclude,
    )


def list_scenarios(options: SuiteOptions) -> list[ScenarioInfo]:
    """The scenarios ``options`` selects, in run order (see [Note: the matrix] in
    :mod:`reffsdp.testing.suite_scenarios`; the wrapper has no tensor-parallel meshes)."""
    return [_info(spec, options) for spec in _selected(options)]


# -- one scenario on one rank ---------------------------------------------------------------


def _skipped(spec: ScenarioSpec, options: SuiteOptions, reason: str) -> ScenarioResult:
    info = _info(spec, options)
    return ScenarioResult(
        **_identity(info), status="skipped", message=reason, steps=options.steps, seconds=0.0
    )


def _identity(info: ScenarioInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "api": info.api,
        "mesh": info.mesh,
        "feature": info.feature,
        "model": info.model,
        "world_size": info.world_size,
    }


def describe_parity_failure(messages: Sequence[str]) -> str:
    """What a failed ``check_train_parity`` found, from every rank's message.

    The first line is ``"<check>: <where>: <first problem>"``; the check is ``losses``,
    ``gradients`` (after backward) or ``parameters``. Then each failing rank's whole message
    (see [Note: a failure on another rank])::

        >>> matched = "step 1 losses: parity check failed on rank(s) [1]; rank 0 matched"
        >>> failed = "step 1 losses: parity check failed on rank 1:\\n  loss 2.5 vs 2"
        >>> print(describe_parity_failure([matched, failed]))
        losses: step 1 losses: loss 2.5 vs 2
        step 1 losses: parity check failed on rank 1:
          loss 2.5 vs 2
    """
    texts = [message.strip() for message in messages if message.strip()]
    detailed = [text for text in texts if "\n" in text] or texts[:1] or ["parity check failed"]
    lines = [line.strip() for line in detailed[0].splitlines() if line.strip()]
    stage = lines[0].split(": parity check failed")[0]
    if "losses" in stage:
        check = "losses"
    elif "after backward" in stage:
        check = "gradients"
    else:
        check = "parameters"
    first_problem = lines[1] if len(lines) > 1 else lines[0]
    return "\n".join([f"{check}: {stage}: {first_problem}", *detailed])


def _gather_failures(
    error: AssertionError, diffs: ParityDiffs | None
) -> tuple[list[str], ParityDiffs | None]:
    """Every rank's failure message, and the largest differences of any rank (every rank
    calls this together; see [Note: a failure on another rank])."""
    own = (str(error), None if diffs is None else dataclasses.asdict(diffs))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    merged: ParityDiffs | None = None
    for _, fields in gathered:
        merged = _merge(merged, None if fields is None else ParityDiffs(**fields))
    return [message for message, _ in gathered], merged


def _merge(a: ParityDiffs | None, b: ParityDiffs | None) -> ParityDiffs | None:
    if a is None or b is None:
        return a or b
    merged = ParityDiffs()
    for field in dataclasses.fields(ParityDiffs):
        values = [v for v in (getattr(a, field.name), getattr(b, field.name)) if v is not None]
        setattr(merged, field.name, max(values) if values else None)
    return merged


def _train(built: BuiltScenario, model: Any, ref_model: Any, steps: int, tally: CommTally):
    with observe_collectives(tally.observe):
        return check_train_parity(
            None, ref_model, model, built.make_inputs, num_steps=steps, **built.check_kwargs
        )


def _state_dict_phases(steps: int) -> tuple[int, int]:
    """Steps before saving and after loading (at least one after)."""
    before = (steps + 1) // 2
    return before, max(1, steps - before)


def run_scenario(
    spec: ScenarioSpec,
    device: torch.device,
    *,
    steps: int = 3,
    seed: int = 0,
    world_size: int | None = None,
) -> ScenarioResult:
    """Run ``spec`` on this rank; every rank of the default group calls it together.

    Every rank returns the same verdict (parity checks agree across ranks; the counts are
    this rank's). A parity failure is a failed result, not an exception; anything else
    raised (a crash inside reffsdp) propagates, since the ranks may be out of step.
    """
    start = time.perf_counter()
    ws = dist.get_world_size() if world_size is None else world_size
    result = ScenarioResult(
        name=spec.name,
        api=spec.api,
        mesh=spec.mesh,
        feature=spec.feature,
        model=spec.model,
        status="passed",
        message="",
        world_size=ws,
        steps=steps,
    )
    if spec.skip:
        result.status, result.message = "skipped", spec.skip
        return result
    # No torch.manual_seed here: under threaded ranks it would reseed the RNG another rank
    # is building from. Models are built seeded, one at a time (testing.build.build_seeded).
    built = build_scenario(spec, device, seed=seed)
    tally = CommTally()
    trained_steps = steps
    diffs: ParityDiffs | None = None
    try:
        if built.reload is None:
            trained = _train(built, built.model, built.ref_model, steps, tally)
            diffs = trained.diffs
            result.losses = list(trained)
        else:
            import copy

            before, after = _state_dict_phases(steps)
            trained_steps = before + after
            trained = _train(built, built.model, built.ref_model, before, tally)
            diffs = trained.diffs
            result.losses = list(trained)
            fresh = built.reload(built.model)
            ref_model = copy.deepcopy(built.ref_model)
            trained = _train(built, fresh, ref_model, after, tally)
            diffs = _merge(diffs, trained.diffs)
            result.losses += list(trained)
    except AssertionError as error:
        if not hasattr(error, "parity"):  # not the checker's (agreed) verdict: a crash
            raise
        result.status = "failed"
        result.traceback = traceback.format_exc()
        messages, diffs = _gather_failures(error, _merge(diffs, error.parity))
        result.message = describe_parity_failure(messages)
    if diffs is not None:
        result.max_loss_diff = diffs.max_loss_diff
        result.max_grad_diff = diffs.max_grad_diff
        result.max_param_diff = diffs.max_param_diff
        result.rtol, result.atol = diffs.rtol, diffs.atol
    counts, nbytes = tally.per_step(trained_steps)
    expected, minimum = expected_per_step(built.units, built.shape)
    result.counts, result.expected_counts = counts, expected
    result.bytes_per_step, result.min_bytes_per_step = round(nbytes), round(minimum)
    if result.status == "passed":
        result.status, result.message = _check_comms(counts, expected, nbytes, minimum)
    result.seconds = time.perf_counter() - start
    return result


def _check_comms(
    counts: dict[str, float], expected: dict[str, float], nbytes: Fraction, minimum: Fraction
) -> tuple[str, str]:
    wrong = [
        f"{key} {counts.get(key, 0.0):g} per step, expected {want:g}"
        for key, want in expected.items()
        if counts.get(key, 0.0) != want
    ]
    if wrong:
        return "failed", "counts: " + "; ".join(wrong)
    if nbytes != minimum:
        return "failed", (
            f"bytes: {float(nbytes):.0f} sent per rank per step, analytic minimum "
            f"{float(minimum):.0f}"
        )
    return "passed", ""


# -- backends -------------------------------------------------------------------------------


BugFactory = Callable[[], AbstractContextManager[Any]]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep expected noise out of the suite's output: the deprecation warnings the
    wrapper's state-dict API repeats from torch's, and DTensor's note that gathering a full
    tensor of a 2-D sharded parameter takes two all-gathers (the full state dicts)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
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
    info = _info(spec, options)
    return ScenarioResult(
        **_identity(info),
        status="failed",
        message=message,
        steps=options.steps,
        seconds=seconds,
        traceback=trace,
    )


def _run_threaded_one(
    spec: ScenarioSpec, options: SuiteOptions, bug: BugFactory | None = None
) -> ScenarioResult:
    from .multithread import RankFailure, run_threaded

    world_size = spec.world_size(options.world_size, resize=True)
    found: dict[int, ScenarioResult] = {}
    device = options.device_for(0)

    def rank_main(rank: int) -> None:
        found[rank] = run_scenario(
            spec, device, steps=options.steps, seed=options.seed, world_size=world_size
        )

    start = time.perf_counter()
    try:
        with _quiet(), bug() if bug is not None else nullcontext():
            run_threaded(rank_main, world_size, timeout_s=_SCENARIO_TIMEOUT_S)
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
        reason = spec.fits(spec.world_size(options.world_size, resize=True))
        if reason:
            yield _skipped(spec, options, reason)
            continue
        if options.device == "cuda" and not torch.cuda.is_available():
            yield _skipped(spec, options, "no CUDA device")
            continue
        yield _run_threaded_one(spec, options, bug)


def _process_main(
    world: RankWorld,
    channel: Connection,
    options: SuiteOptions,
    specs: list[ScenarioSpec],
    bug_name: str | None,
) -> None:
    """A rank process: run every scenario in turn; rank 0 sends each result."""
    if options.backend == "nccl":
        torch.cuda.set_device(world.rank)
    world.init_process_group(options.backend, timedelta(seconds=_SCENARIO_TIMEOUT_S))
    bug: BugFactory | None = None
    if bug_name is not None:
        from .self_test import bug_context

        bug = bug_context(bug_name)
    try:
        broken = ""
        for spec in specs:
            if broken:
                result = _crashed(spec, options, broken, 0.0)
            else:
                start = time.perf_counter()
                try:
                    with _quiet(), bug() if bug is not None else nullcontext():
                        result = run_scenario(
                            spec,
                            options.device_for(world.rank),
                            steps=options.steps,
                            seed=options.seed,
                            world_size=world.world_size,
                        )
                    dist.barrier()
                except Exception as error:  # noqa: BLE001 - reported; the ranks are out of step
                    result = _crashed(
                        spec,
                        options,
                        f"error: {_exception_text(error)}",
                        time.perf_counter() - start,
                        traceback.format_exc(),
                    )
                    broken = f"not run: scenario {spec.name} left the ranks out of step"
            if world.rank == 0:
                channel.send(result.to_dict())
    finally:
        dist.destroy_process_group()


def _iter_processes(
    specs: Sequence[ScenarioSpec], options: SuiteOptions, bug_name: str | None = None
) -> Iterator[ScenarioResult]:
    world_size = options.world_size
    runnable = []
    for spec in specs:
        reason = spec.fits(world_size)
        if not reason and options.backend == "nccl" and torch.cuda.device_count() < world_size:
            reason = f"nccl needs {world_size} GPUs, found {torch.cuda.device_count()}"
        if reason:
            yield _skipped(spec, options, reason)
        else:
            runnable.append(spec)
    if not runnable:
        return
    seen = 0
    args = (options, runnable, bug_name)
    with spawn_ranks(_process_main, world_size, args, name="parity") as ranks:
        try:
            for _, item in ranks.messages():  # rank 0's results; the others send none
                seen += 1
                yield ScenarioResult(**item)
        except RankFailed as failure:  # a rank died: report what never ran
            message = f"error: a rank process failed: {_last_exception(failure.detail)}"
            for spec in runnable[seen:]:
                yield _crashed(spec, options, message, 0.0, str(failure))
            return
    for spec in runnable[seen:]:
        yield _crashed(spec, options, "error: the rank processes ended early", 0.0)


def iter_results(
    specs: Sequence[ScenarioSpec], options: SuiteOptions, bug_name: str | None = None
) -> Iterator[ScenarioResult]:
    """Run ``specs`` on ``options.backend``; yields each result as it finishes."""
    if options.backend == "threaded":
        bug = None
        if bug_name is not None:
            from .self_test import bug_context

            bug = bug_context(bug_name)
        return _iter_threaded(specs, options, bug)
    return _iter_processes(specs, options, bug_name)


def run_suite(
    options: SuiteOptions,
    on_result: Callable[[ScenarioResult], None] | None = None,
) -> list[ScenarioResult]:
    """Run every scenario :func:`list_scenarios` lists, on ``options.backend``.

    ``on_result`` is called in this process as each scenario finishes. A scenario whose
    collective counts differ from the expected counts, or whose bytes differ from the
    analytic minimum, is "failed" even when every number matches DDP.
    """
    results = []
    for result in iter_results(_selected(options), options):
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


# -- for users: the scenarios on their own model ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParityScenario:
    """One parity scenario to run in a user's own tests (see :func:`parity_scenarios`).

    :meth:`run` runs it on every rank of an initialized default group (inside
    ``FSDPTestMultiThread`` or ``FSDPTest``); :meth:`run_threaded` starts a threaded world of
    :attr:`world_size` ranks itself, for a plain pytest function. Either returns a
    :class:`ScenarioResult`; ``status == "passed"`` is what to assert.
    """

    spec: ScenarioSpec
    world_size: int
    steps: int = 3
    seed: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def __str__(self) -> str:
        return self.name

    def run(self, device: torch.device | str | None = None) -> ScenarioResult:
        if device is None:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return run_scenario(self.spec, torch.device(device), steps=self.steps, seed=self.seed)

    def run_threaded(self, device: str = "cpu") -> ScenarioResult:
        options = SuiteOptions(
            device=device, world_size=self.world_size, steps=self.steps, seed=self.seed
        )
        return _run_threaded_one(self.spec, options)


def parity_scenarios(
    model_factory: Callable[[], torch.nn.Module] | None = None,
    make_inputs: Callable[[int, int], Any] | None = None,
    *,
    block_types: Sequence[type[torch.nn.Module]] = (),
    apis: Sequence[str] = APIS,
    meshes: Sequence[str] | None = None,
    features: Sequence[str] | None = None,
    world_size: int = 4,
    steps: int = 3,
    seed: int = 0,
    name: str = "custom",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
    rtol: Tolerance = None,
    atol: Tolerance = None,
) -> list[ParityScenario]:
    """Parity scenarios to run in your own test suite.

    Without ``model_factory``: the suite's own matrix, filtered by ``apis``, ``meshes`` and
    ``features``. With it: your model under both APIs (or ``apis``), on the ``1d`` and
    ``hsdp`` meshes (or ``meshes``), with the features ``fp32``, ``reshard``, ``accum``,
    ``offload``, ``sd-full`` and ``sd-sharded`` (or ``features``; ``bf16`` and
    ``orig-params`` may be added; ``orig-params`` runs under the wrapper only).
    ``model_factory()`` builds the unsharded model on the CPU; each scenario builds it seeded
    and then copies rank 0's weights to every rank, so a factory that draws its weights from
    torch's RNG gives every rank the same model. ``make_inputs(iteration, rank)`` returns one
    forward's inputs: a tensor, a tuple of positional arguments or a dict of keyword
    arguments, tensors nested in them moved to the scenario's device. Each module of
    ``block_types`` is sharded (or wrapped) on its own before the root; classes that match
    no module fail the scenario, as does a block left unsharded.

    ``loss_fn`` maps the model's output to a scalar (default: the sum of every output
    tensor; a model returning an output object needs one, e.g. ``lambda out: out.loss``);
    ``optimizer_factory`` builds an optimizer from parameters (default: plain SGD,
    ``lr=1e-3``); ``rtol``/``atol`` replace the default tolerance, which is derived from
    the dtype and the world size (see [Note: default tolerances] in
    :mod:`reffsdp.testing.tolerances`), with one number for every dtype or a mapping per
    dtype. The scenario names read ``"<api>/<mesh>/<feature>/<name>"``.

    Unknown ``apis``, ``meshes`` or ``features``, and a selection that leaves no scenario,
    raise ``ValueError``.
    """
    if (model_factory is None) != (make_inputs is None):
        raise ValueError("pass both model_factory and make_inputs, or neither")
    unknown = sorted(set(apis) - set(APIS))
    if unknown:
        raise ValueError(f"unknown API(s) {unknown}; pick from {list(APIS)}")
    if model_factory is None:
        custom_options = {
            "block_types": block_types,
            "loss_fn": loss_fn,
            "optimizer_factory": optimizer_factory,
            "rtol": rtol,
            "atol": atol,
        }
        given = [key for key, value in custom_options.items() if value not in (None, ())]
        if given:
            raise ValueError(f"{', '.join(given)} apply to your own model: pass model_factory")
        _check_features(features, FEATURES)
        specs = select(all_specs(), api=tuple(apis), mesh=tuple(meshes or ()))
        if features is not None:
            specs = [spec for spec in specs if spec.feature in features]
    else:
        assert make_inputs is not None
        _check_features(features, (*CUSTOM_FEATURES, *CUSTOM_OPTIONAL_FEATURES))
        custom = CustomModel(
            model_factory,
            make_inputs,
            check_block_types(block_types),
            loss_fn=loss_fn,
            optimizer_factory=optimizer_factory,
            rtol=rtol,
            atol=atol,
        )
        wanted_meshes = tuple(meshes or WRAPPER_MESHES)
        bad = sorted(set(wanted_meshes) - set(WRAPPER_MESHES))
        if bad:
            raise ValueError(
                f"mesh(es) {bad} need a tensor-parallel plan for your model; a custom model "
                f"runs on {list(WRAPPER_MESHES)}"
            )
        specs = []
        for api in apis:
            for mesh in wanted_meshes:
                for feature in features or CUSTOM_FEATURES:
                    if feature == "orig-params" and api != "wrapper":
                        continue
                    specs.append(ScenarioSpec(api, mesh, feature, name, custom=custom))
    if not specs:
        raise ValueError(
            f"no scenario runs apis={list(apis)}, meshes={meshes}, features={features} "
            "(orig-params runs under the wrapper only)"
        )
    options = SuiteOptions(world_size=world_size)
    return [
        ParityScenario(
            spec, spec.world_size(world_size, resize=options.resizes_worlds), steps, seed
        )
        for spec in specs
    ]


def _check_features(features: Sequence[str] | None, known: Sequence[str]) -> None:
    if isinstance(features, str):
        raise TypeError(f"features is a sequence of names, e.g. [{features!r}], not a string")
    unknown = sorted(set(features or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; pick from {list(known)}")


__all__ = [
    "MESHES",
    "ParityScenario",
    "ScenarioInfo",
    "ScenarioResult",
    "SuiteOptions",
    "list_scenarios",
    "parity_scenarios",
    "run_scenario",
    "run_suite",
]


from .self_test import SelfTestResult, run_self_test  # noqa: E402 - part of this API

__all__ += ["SelfTestResult", "run_self_test"]
