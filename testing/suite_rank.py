"""One parity scenario on one rank: train next to DDP, compare, count the collectives.

:func:`run_scenario` builds a scenario (see :mod:`reffsdp.testing.suite_scenarios`), copies
it for the DDP reference, shards the original with ``fully_shard``, the
``FullyShardedDataParallel`` wrapper or ``NaiveFSDP``, and trains both with
:func:`~reffsdp.testing.parity.check_train_parity` (losses, gradients and parameters
compared at every step). Meanwhile every all-gather, reduce-scatter and all-reduce reffsdp
issues is counted and sized (see [Note: bytes sent per rank] in
:mod:`reffsdp.testing.expected_comms`). The result is "passed" when the numbers agree AND
the collectives per step equal the expected counts AND the bytes sent equal the analytic
minimum. Every rank of the default group calls it together; where the ranks come from is
:mod:`reffsdp.testing.suite_backends`' business. The FSDP that shards is the implementation
under test (:mod:`reffsdp.testing.impls`): reffsdp by default, torch's, or any other.

[Note: why the engine counts through the comms seam]
A ``CommCounter`` would also count DDP's all-reduces, the parity check's own verdict
all-reduces and DTensor's tensor-parallel collectives, none of which FSDP issued. The
engine observes reffsdp's single collective seam (:mod:`reffsdp.core.comms`) instead, and
only while the sharded model runs a forward, a backward or an optimizer step
(``check_train_parity``'s ``around_sharded_step``; state-dict saving and loading are not a
training step). Another implementation has no such seam: there the engine observes what
``torch.distributed`` issues in those same moments, DTensor's functional collectives left
out (:class:`~reffsdp.testing.comm_counter.IssuedCollectives`), which sees the same
collectives of reffsdp.

[Note: unsupported and not applicable]
A scenario the implementation refuses to set up is *unsupported*, with the implementation's
own message: it raised while sharding or configuring the model (say torch's ``fully_shard``
with CPU offload on a machine without an accelerator), or before it issued any collective:
when the checker first reads its parameters (through its public API) or in its first
training step, which is where an implementation that sets itself up lazily, as torch's
wrapper does, refuses. Ranks agree on it
before going on, so all return it together. It never passes; it is not a failure of the
checks either, and the command line fails the run on it unless told
``--allow-unsupported``. A scenario of an API the implementation does not export (or of
``naive``, reffsdp's own) is *not applicable* and does not run.

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
import copy
import dataclasses
import time
import traceback
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from .expected_comms import CommTally, expected_per_step
from .impls import DEFAULT, Implementation, resolve
from .parity import ParityDiffs, check_train_parity
from .suite_scenarios import BuiltScenario, ScenarioSpec, Unsupported, build_scenario

UNSUPPORTED, NOT_APPLICABLE = "unsupported", "not_applicable"


@dataclasses.dataclass
class ScenarioResult:
    name: str
    api: str
    mesh: str
    feature: str
    model: str
    status: str  # "passed" | "failed" | "skipped" | "unsupported" | "not_applicable"
    message: str  # failure text, skip reason, the implementation's refusal ("" when passed)
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


class _ShardedSteps:
    """What happens around each step of the sharded model (its forwards and backwards, its
    optimizer step): ``impl``'s collectives are counted in ``tally``, and what it raises in
    the first, before any collective, is its refusal to set up ([Note: unsupported and not
    applicable])."""

    def __init__(self, impl: Implementation, tally: CommTally) -> None:
        self.impl = impl
        self.tally = tally
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.entered += 1
        try:
            with self.impl.observe_collectives(self.tally.record):
                yield
        except Exception as error:
            if self.entered > 1 or self.tally.counts or isinstance(error, AssertionError):
                raise
            text = "".join(traceback.format_exception_only(type(error), error)).strip()
            raise Unsupported(
                f"{self.impl.name}'s first training step raised {text}\n(before any "
                "collective: the implementation was setting itself up)"
            ) from error


def _train(built: BuiltScenario, model: Any, ref_model: Any, steps: int, around: _ShardedSteps):
    try:
        return check_train_parity(
            None,
            ref_model,
            model,
            built.make_inputs,
            num_steps=steps,
            around_sharded_step=around,
            **built.check_kwargs,
        )
    except Exception as error:
        # Before the first step the checker only reads the sharded model's parameters, through
        # the implementation's public API; an implementation that sets itself up lazily (torch's
        # wrapper) may refuse right there.
        if around.entered or around.tally.counts or isinstance(error, AssertionError):
            raise
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        raise Unsupported(
            f"{around.impl.name} raised {text}\n(before its first training step, as its "
            "parameters were first read: the implementation was setting itself up)"
        ) from error


def _state_dict_phases(steps: int) -> tuple[int, int]:
    """Steps before saving and after loading (at least one after)."""
    before = (steps + 1) // 2
    return before, max(1, steps - before)


def _train_phases(
    built: BuiltScenario,
    steps: int,
    seen: list[ParityDiffs],
    losses: list[float],
    around: _ShardedSteps,
) -> None:
    """Train ``built`` against its reference for ``steps`` steps, or, for a state-dict
    scenario, part of them, then save, load into a fresh model and train the rest; each
    phase's differences go to ``seen`` and its losses to ``losses`` as it ends."""

    def phase(model: Any, ref_model: Any, count: int) -> None:
        trained = _train(built, model, ref_model, count, around)
        seen.append(trained.diffs)
        losses.extend(trained)

    if built.reload is None:
        phase(built.model, built.ref_model, steps)
        return
    before, after = _state_dict_phases(steps)
    phase(built.model, built.ref_model, before)
    phase(built.reload(built.model), copy.deepcopy(built.ref_model), after)


def _merged(seen: list[ParityDiffs]) -> ParityDiffs | None:
    merged: ParityDiffs | None = None
    for diffs in seen:
        merged = _merge(merged, diffs)
    return merged


def _record_diffs(result: ScenarioResult, diffs: ParityDiffs | None) -> None:
    if diffs is not None:
        result.max_loss_diff = diffs.max_loss_diff
        result.max_grad_diff = diffs.max_grad_diff
        result.max_param_diff = diffs.max_param_diff
        result.rtol, result.atol = diffs.rtol, diffs.atol


def _record_comms(
    result: ScenarioResult, built: BuiltScenario, tally: CommTally, trained_steps: int
) -> None:
    """The collectives per step against those expected; a passed scenario that sent other
    counts, or fewer bytes than the minimum, fails here."""
    counts, nbytes = tally.per_step(trained_steps)
    builds = 1 if built.reload is None else 2
    expected, minimum = expected_per_step(
        built.units, built.shape, steps=trained_steps, builds=builds
    )
    result.counts, result.expected_counts = counts, expected
    result.bytes_per_step, result.min_bytes_per_step = round(nbytes), round(minimum)
    if result.status == "passed":
        result.status, result.message = _check_comms(counts, expected, nbytes, minimum)


def run_scenario(
    spec: ScenarioSpec,
    device: torch.device,
    *,
    steps: int = 3,
    seed: int = 0,
    world_size: int | None = None,
    nodes: int = 1,
    impl: Implementation | str = DEFAULT,
) -> ScenarioResult:
    """Run ``spec`` on this rank with the FSDP implementation ``impl`` (see
    :mod:`reffsdp.testing.impls`); every rank of the default group calls it together.

    Every rank returns the same verdict (parity checks agree across ranks; the counts are
    this rank's); ``nodes`` (a launched world's) shape the HSDP mesh. A parity failure is a
    failed result, not an exception, and so is a scenario ``impl`` refuses to set up (an
    unsupported one: [Note: unsupported and not applicable]); anything else raised (a
    crash inside the implementation) propagates, since the ranks may be out of step.
    """
    impl = resolve(impl)
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
    reason = impl.not_applicable(spec.api)
    if reason:
        result.status, result.message = NOT_APPLICABLE, reason
        return result
    # No torch.manual_seed here: under threaded ranks it would reseed the RNG another rank
    # is building from. Models are built seeded, one at a time (testing.build.build_seeded).
    try:
        built = build_scenario(spec, device, impl, seed=seed, nodes=nodes)
        refusal = None
    except Unsupported as error:
        refusal = error
    if _refused(result, refusal, device):
        result.seconds = time.perf_counter() - start
        return result
    tally = CommTally()
    seen: list[ParityDiffs] = []  # each training phase's differences
    try:
        _train_phases(built, steps, seen, result.losses, _ShardedSteps(impl, tally))
    except Unsupported as error:  # refused to shard the reloaded model of a state-dict one
        _refused(result, error, device)
        result.seconds = time.perf_counter() - start
        return result
    except AssertionError as error:
        if not hasattr(error, "parity"):  # not the checker's (agreed) verdict: a crash
            raise
        result.status = "failed"
        result.traceback = traceback.format_exc()
        messages, diffs = _gather_failures(error, _merge(_merged(seen), error.parity))
        result.message = describe_parity_failure(messages)
        seen = [] if diffs is None else [diffs]
    _record_diffs(result, _merged(seen))
    trained_steps = steps if built.reload is None else sum(_state_dict_phases(steps))
    _record_comms(result, built, tally, trained_steps)
    result.seconds = time.perf_counter() - start
    return result


def _refused(result: ScenarioResult, refusal: Unsupported | None, device: torch.device) -> bool:
    """Whether any rank's implementation refused the scenario; if so, ``result`` is
    unsupported on every rank, with the refusals' messages (each rank's when they differ)."""
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")  # NCCL: CUDA only
    refused = torch.tensor([float(refusal is not None)], device=on)
    dist.all_reduce(refused)
    if not refused.item():
        return False
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if refusal is None else str(refusal))
    distinct = list(dict.fromkeys(message for message in messages if message is not None))
    result.status = UNSUPPORTED
    if len(distinct) == 1 and None not in messages:
        result.message = distinct[0]
    else:
        result.message = "\n".join(
            f"rank {rank}: {message}" for rank, message in enumerate(messages) if message
        )
    if refusal is not None:
        result.traceback = "".join(traceback.format_exception(refusal.__cause__ or refusal))
    return True


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
