"""What the parity suite's command line prints and writes, as pure functions of its results.

Everything here takes the engine's results (:class:`~reffsdp.testing.parity_suite.ScenarioResult`
and ``SelfTestResult``, read by attribute) plus a :class:`RunInfo`, and returns text or a
JSON-ready dict; ``python -m reffsdp.testing`` (``testing/__main__.py``) does
the printing and the file writing. Three outputs:

* the terminal: a progress line per scenario as it finishes, then a table (drawn by
  ``rich``, as wide as the terminal allows), a summary line and the failures with their
  whole messages and tracebacks;
* ``--json FILE``: run metadata, a summary and every result's ``to_dict()``;
* ``--junit-xml FILE``: pytest's JUnit XML (one ``testcase`` per scenario), with the run's
  metadata (:func:`junit_properties`) and each scenario's numbers (:func:`metrics_line`).

Per-step collective counts are shown next to what the scenario expects, ``measured/expected``,
with a ``!`` where they differ::

    >>> format_count(4, 4)
    '4/4'
    >>> format_count(2.5, 3)
    '2.5/3!'
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
# What an implementation other than reffsdp may come to (see [Note: unsupported and not
# applicable] in suite_rank.py): refused to set up, with its message; an API it lacks.
UNSUPPORTED, NOT_APPLICABLE = "unsupported", "not_applicable"
_NOT_RUN = (SKIPPED, UNSUPPORTED, NOT_APPLICABLE)

# Table columns for the per-step collective counts: (short header, key in ``counts``).
COUNT_COLUMNS = (("AG", "all_gather"), ("RS", "reduce_scatter"), ("AR", "all_reduce"))

_STATUS_WORDS = {
    PASSED: "PASS",
    FAILED: "FAIL",
    SKIPPED: "SKIP",
    UNSUPPORTED: "UNSUPPORTED",
    NOT_APPLICABLE: "N/A",
}


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What one run of the suite was: versions, options, when it started, how long it took."""

    torch_version: str
    reffsdp_version: str
    impl: str  # the FSDP implementation checked: "reffsdp", "torch" or a module path
    impl_version: str  # its __version__ (torch's for torch)
    python_version: str
    device: str  # "cpu" or "cuda"
    device_name: str  # the GPU's name, or the CPU's
    backend: str
    world_size: int
    launcher: str  # "spawn" (this command started the ranks), "torchrun" or "srun"
    nodes: int
    ranks_per_node: int
    seed: int
    steps: int
    started: str  # ISO 8601, UTC
    seconds: float
    filters: dict[str, list[str]]  # api, mesh, only, exclude as given ([] = all)


# --- the terminal -------------------------------------------------------------------------


def status_word(status: str) -> str:
    """``PASS``, ``FAIL``, ``SKIP``, ``UNSUPPORTED`` or ``N/A``; an unknown status is shown
    upper-cased."""
    return _STATUS_WORDS.get(status, status.upper())


def is_failure(status: str) -> bool:
    """Anything but passed, skipped, unsupported or not applicable counts as a failure
    (for the exit code too; unsupported fails it on its own, unless allowed)."""
    return status not in (PASSED, *_NOT_RUN)


def first_line(text: str, limit: int = 100) -> str:
    """The first non-empty line of ``text``, cut to ``limit`` characters."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def progress_line(index: int, total: int, result: Any) -> str:
    """One scenario as it finishes: ``[12/40] PASS fully_shard/hsdp/bf16/mlp 1.2 s``.

    Failures and skips add the first line of their message.
    """
    line = f"[{index}/{total}] {status_word(result.status)} {result.name} {result.seconds:.1f} s"
    if result.status != PASSED and result.message:
        line += f"  ({first_line(result.message)})"
    return line


def format_number(value: float) -> str:
    """A count per step: whole numbers as integers, others with up to 3 digits."""
    return f"{value:.3g}"


def counts_differ(measured: float, expected: float) -> bool:
    return not math.isclose(measured, expected, rel_tol=1e-9, abs_tol=1e-9)


def format_count(measured: float | None, expected: float | None) -> str:
    """``measured/expected`` collectives per step, ``!`` appended where they differ."""
    if measured is None and expected is None:
        return "-"
    measured, expected = measured or 0.0, expected or 0.0
    mark = "!" if counts_differ(measured, expected) else ""
    return f"{format_number(measured)}/{format_number(expected)}{mark}"


def format_bytes(value: int | None) -> str:
    """Binary units, one decimal: ``format_bytes(1536)`` is ``'1.5 KiB'``."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def format_tolerance(atol: float | None, rtol: float | None) -> str:
    if atol is None and rtol is None:
        return "-"
    return "/".join("-" if value is None else f"{value:g}" for value in (atol, rtol))


_HEADERS = (
    "scenario",
    "status",
    "steps",
    "Δloss",
    "Δgrad",
    "Δparam",
    "atol/rtol",
    *(header for header, _ in COUNT_COLUMNS),
    "bytes/rank/step (min)",
    "s",
)
_LEFT_ALIGNED = {"scenario", "status"}
# What a narrow terminal leaves out, first to last; the rest always show (the scenario name
# wraps when even they do not fit).
_DROPPED_FIRST = ("bytes/rank/step (min)", "steps", "atol/rtol", "s")
_LEGEND = {
    "Δloss": "Δloss/Δgrad/Δparam: the largest |difference| from DDP",
    "AG": "AG/RS/AR: all-gathers, reduce-scatters, all-reduces per step, measured/expected "
    "(! = differs)",
    "bytes/rank/step (min)": "bytes sent per rank per step (analytic minimum)",
}
_MIN_NAME_WIDTH = 20  # the scenario column breaks names, but is never narrower than this


def table_row(result: Any) -> list[str]:
    """One scenario's cells, in the order of the table's headers."""
    counts, expected = result.counts or {}, result.expected_counts or {}
    if result.bytes_per_step is None and result.min_bytes_per_step is None:
        traffic = "-"
    else:
        traffic = (
            f"{format_bytes(result.bytes_per_step)} ({format_bytes(result.min_bytes_per_step)})"
        )
    return [
        result.name,
        status_word(result.status),
        str(result.steps),
        format_diff(result.max_loss_diff),
        format_diff(result.max_grad_diff),
        format_diff(result.max_param_diff),
        format_tolerance(result.atol, result.rtol),
        *(
            "-" if result.status in _NOT_RUN else format_count(counts.get(key), expected.get(key))
            for _, key in COUNT_COLUMNS
        ),
        traffic,
        f"{result.seconds:.1f}",
    ]


def format_table(results: Sequence[Any], width: int | None = None) -> str:
    """Every scenario's numbers, aligned, with a legend for the columns.

    ``width`` is the terminal's: columns are left out (bytes first, then steps, tolerances
    and seconds, as the legend then says) until the table fits, and scenario names break at
    a ``/`` if it still does not. Without ``width`` (a file or a pipe) every column is
    shown, each row on one line.
    """
    rows = [table_row(result) for result in results]
    shown = list(_HEADERS)
    for header in _DROPPED_FIRST:
        if width is None or _natural_width(_table(rows, shown)) <= width:
            break
        shown.remove(header)
    table = _table(rows, shown)
    natural = _natural_width(table)
    if width is not None and natural > width:
        longest = max(len(row[0]) for row in [list(_HEADERS), *rows])
        room = max(_MIN_NAME_WIDTH, width - (natural - longest))
        table = _table([[_break_name(row[0], room), *row[1:]] for row in rows], shown)
        natural = _natural_width(table)  # wider than ``width`` only where nothing fits
    legend = [text for header, text in _LEGEND.items() if header in shown]
    left_out = [header for header in _HEADERS if header not in shown]
    if left_out:
        legend.append(f"not shown at this width: {', '.join(left_out)} (see --json)")
    return _render([table, Text("; ".join(legend))], max(width or 0, natural))


def _break_name(name: str, width: int) -> str:
    """``name`` on lines of at most ``width`` characters, broken after a ``/``::

    >>> print(_break_name("fully_shard/hsdp/sd-full/transformer", 20))
    fully_shard/hsdp/
    sd-full/transformer
    """
    lines = [""]
    for part in re.findall(r"[^/]+/?", name):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


def _table(rows: list[list[str]], shown: list[str]) -> Table:
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for header in shown:
        table.add_column(
            header,
            justify="left" if header in _LEFT_ALIGNED else "right",
            no_wrap=True,
            overflow="fold",
        )
    columns = [_HEADERS.index(header) for header in shown]
    for row in rows:
        table.add_row(*(row[column] for column in columns))
    return table


def _console(width: int, file: io.StringIO | None = None) -> Console:
    return Console(
        file=file or io.StringIO(),
        width=width,
        color_system=None,
        force_terminal=False,
        highlight=False,
        emoji=False,
        markup=False,
    )


def _natural_width(table: Table) -> int:
    return _console(1 << 16).measure(table).maximum


def _render(renderables: list[Any], width: int) -> str:
    text = io.StringIO()
    console = _console(width, text)
    for renderable in renderables:
        console.print(renderable)
    return "\n".join(line.rstrip() for line in text.getvalue().splitlines())


def summarize(results: Sequence[Any]) -> dict[str, int]:
    """``{"total", "passed", "failed", "skipped"}``, with ``"unsupported"`` and
    ``"not_applicable"`` added when some are; unknown statuses count as failed."""
    tally = {status: sum(r.status == status for r in results) for status in (PASSED, *_NOT_RUN)}
    counts = {
        "total": len(results),
        "passed": tally[PASSED],
        "failed": len(results) - sum(tally.values()),
        "skipped": tally[SKIPPED],
    }
    counts.update(
        {status: tally[status] for status in (UNSUPPORTED, NOT_APPLICABLE) if tally[status]}
    )
    return counts


def summary_line(results: Sequence[Any], seconds: float) -> str:
    """``40 passed, 0 failed, 2 skipped in 95.3 s``; unsupported and not applicable
    scenarios are counted where there are some::

    >>> from types import SimpleNamespace as Result
    >>> statuses = ["passed", "failed", "unsupported", "skipped", "not_applicable"]
    >>> summary_line([Result(status=status) for status in statuses], 2.0)
    '1 passed, 1 failed, 1 unsupported, 1 skipped, 1 not applicable in 2.0 s'
    """
    counts = summarize(results)
    unsupported = counts.get(UNSUPPORTED, 0)
    not_applicable = counts.get(NOT_APPLICABLE, 0)
    return (
        f"{counts['passed']} passed, {counts['failed']} failed, "
        + (f"{unsupported} unsupported, " if unsupported else "")
        + f"{counts['skipped']} skipped"
        + (f", {not_applicable} not applicable" if not_applicable else "")
        + f" in {seconds:.1f} s"
    )


def format_failures(results: Sequence[Any]) -> str:
    """Each failed scenario with its whole message and any traceback, indented; ``""`` when
    none failed."""
    sections = []
    for result in results:
        if is_failure(result.status):
            body = failure_text(result)
            sections.append(f"FAILED {result.name}\n" + _indent(body))
    return "\n".join(sections)


def failure_text(result: Any) -> str:
    """A failed scenario's whole message, then its traceback when it has one."""
    message = result.message.strip() or "(no message)"
    trace = getattr(result, "traceback", "").strip()
    return f"{message}\n\n{trace}" if trace else message


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())


def format_skips(results: Sequence[Any]) -> str:
    """One line per scenario that did not run (skipped, not applicable) with its reason,
    and per unsupported one with the implementation's whole message; ``""`` when none."""
    lines = []
    for status, label in ((SKIPPED, "skipped"), (NOT_APPLICABLE, "not applicable")):
        lines += [
            f"{label} {result.name}: {first_line(result.message, 200) or '(no reason)'}"
            for result in results
            if result.status == status
        ]
    lines += [
        f"unsupported {result.name}: {result.message.strip() or '(no message)'}"
        for result in results
        if result.status == UNSUPPORTED
    ]
    return "\n".join(lines)


# --- the self-test ------------------------------------------------------------------------


def self_test_line(index: int, result: Any) -> str:
    """One planted bug: ``[3] CAUGHT fully_shard: wrong divide factor by gradients: ...``."""
    if result.caught:
        verdict = f"CAUGHT {result.api}: {result.bug}  by {first_line(result.caught_by, 200)}"
    else:
        verdict = f"MISSED {result.api}: {result.bug}  (no check failed)"
    return f"[{index}] {verdict}  {result.seconds:.1f} s"


def summarize_self_test(results: Sequence[Any]) -> dict[str, int]:
    caught = sum(bool(result.caught) for result in results)
    return {"total": len(results), "caught": caught, "missed": len(results) - caught}


def self_test_summary(results: Sequence[Any], seconds: float) -> str:
    """``11 of 12 planted bugs caught in 30.1 s`` and the missed ones by name."""
    counts = summarize_self_test(results)
    line = f"{counts['caught']} of {counts['total']} planted bugs caught in {seconds:.1f} s"
    missed = [f"{result.api}: {result.bug}" for result in results if not result.caught]
    if missed:
        line += "\nMISSED (the suite did not notice these bugs):\n" + "\n".join(
            "    " + name for name in missed
        )
    return line


# --- --json -------------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as strings ("nan", "inf"): JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _run_fields(info: RunInfo) -> dict[str, Any]:
    return dataclasses.asdict(info)


def suite_json(
    info: RunInfo, results: Sequence[Any], error: str | None = None, interrupted: bool = False
) -> dict:
    """The ``--json`` document of a suite run; ``error`` is set when the engine crashed,
    ``interrupted`` when the run was stopped (Ctrl-C) before every scenario ran."""
    document = {
        **_run_fields(info),
        "interrupted": interrupted,
        "summary": summarize(results),
        "scenarios": [result.to_dict() for result in results],
    }
    if error is not None:
        document["error"] = error
    return _json_safe(document)


def self_test_json(
    info: RunInfo, results: Sequence[Any], error: str | None = None, interrupted: bool = False
) -> dict:
    """The ``--json`` document of ``--self-test``: ``summary`` counts caught and missed bugs."""
    document = {
        **_run_fields(info),
        "interrupted": interrupted,
        "summary": summarize_self_test(results),
        "scenarios": [],
        "self_test": [result.to_dict() for result in results],
    }
    if error is not None:
        document["error"] = error
    return _json_safe(document)


# --- --junit-xml (pytest's own report; these fill it) -------------------------------------


def junit_properties(info: RunInfo) -> list[tuple[str, str]]:
    """The run's metadata as the JUnit test suite's properties (pytest's report has the
    start time and the duration itself); ``filters`` is a JSON object."""
    return [
        (key, value if isinstance(value, str) else json.dumps(value))
        for key, value in _run_fields(info).items()
        if key not in ("started", "seconds")
    ]


def metrics_line(result: Any) -> str:
    """One line of a scenario's numbers, its test's output (JUnit's ``system-out``)."""
    cells = dict(zip(_HEADERS, table_row(result)))
    return "  ".join(f"{key} {cells[key]}" for key in _HEADERS[2:])
