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
:mod:`reffsdp.testing.suite_backends`' business.

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

import copy
import dataclasses
import time
import traceback
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from .expected_comms import CommTally, expected_per_step
from .parity import ParityDiffs, check_train_parity
from .patching import observe_collectives
from .suite_scenarios import BuiltScenario, ScenarioSpec, build_scenario


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


def _train_phases(
    built: BuiltScenario,
    steps: int,
    tally: CommTally,
    seen: list[ParityDiffs],
    losses: list[float],
) -> None:
    """Train ``built`` against its reference for ``steps`` steps, or, for a state-dict
    scenario, part of them, then save, load into a fresh model and train the rest; each
    phase's differences go to ``seen`` and its losses to ``losses`` as it ends."""

    def phase(model: Any, ref_model: Any, count: int) -> None:
        trained = _train(built, model, ref_model, count, tally)
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
) -> ScenarioResult:
    """Run ``spec`` on this rank; every rank of the default group calls it together.

    Every rank returns the same verdict (parity checks agree across ranks; the counts are
    this rank's); ``nodes`` (a launched world's) shape the HSDP mesh. A parity failure is a
    failed result, not an exception; anything else
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
    built = build_scenario(spec, device, seed=seed, nodes=nodes)
    tally = CommTally()
    seen: list[ParityDiffs] = []  # each training phase's differences
    try:
        _train_phases(built, steps, tally, seen, result.losses)
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
