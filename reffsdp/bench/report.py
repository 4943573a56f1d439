"""Turn the ranks' raw measurements into summary numbers, a table and a JSON document.

[Note: bytes on the wire]
The collective counter reports each collective's whole buffer on one rank (the unsharded
side for all-gather and reduce-scatter). A ring algorithm sends ``(W - 1) / W`` of that
buffer per rank for an all-gather or reduce-scatter, ``2 (W - 1) / W`` for an all-reduce,
which is what "sent per rank" shows: the parity suite's model of the same bytes
(``ring_bytes``; [Note: bytes sent per rank] in ``reffsdp.testing.expected_comms``). The
analytic minimum for Ψ parameters, with the root's Ψ_root staying unsharded between
forward and backward (as both FSDPs do):

* FULL_SHARD: ``(W - 1) / W * (Ψ b_p + (Ψ - Ψ_root) b_p + Ψ b_r)``: all-gather in
  forward, again in backward for all but the root, reduce-scatter of the gradients; b_p and
  b_r are the bytes per element of the parameter and reduce dtypes;
* SHARD_GRAD_OP (``--no-reshard-after-forward``: every block, like the root, stays
  unsharded from forward to backward): ``(W - 1) / W * (Ψ b_p + Ψ b_r)``: all-gather in
  forward, reduce-scatter of the gradients;
* DDP: ``2 (W - 1) / W * Ψ * 4`` (one fp32 all-reduce of the gradients);
* local: 0.

Padding (each parameter's dim 0 rounded up to a multiple of W) is why a sharded
implementation sends slightly more than the minimum.
"""

from __future__ import annotations

import statistics
from typing import Any

from reffsdp.testing.expected_comms import ring_bytes

from .impls import LABELS, TORCH_FULLY_SHARD, strategy

MB = 1e6
_RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "broadcast": 1}


def quartiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, median, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = median = q3 = ordered[0]
    return {"median": median, "q1": q1, "q3": q3, "min": ordered[0], "max": ordered[-1]}


def sent_per_rank(comm_bytes: dict[str, int], world_size: int) -> float:
    """Bytes one rank sends for these collectives with ring algorithms (see the note)."""
    sent = sum(
        _RING_FACTOR.get(kind, 0) * ring_bytes(n, world_size) for kind, n in comm_bytes.items()
    )
    return float(sent)


def analytic_min_bytes(
    strategy: str | None,
    params: int,
    root_params: int,
    world_size: int,
    *,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
) -> float:
    """The least one rank must send per step (see the module note)."""
    if strategy == "shard":
        gathered = params * param_bytes + (params - root_params) * param_bytes
        return float(ring_bytes(gathered + params * reduce_bytes, world_size))
    if strategy == "shard_grad_op":
        return float(ring_bytes(params * param_bytes + params * reduce_bytes, world_size))
    if strategy == "allreduce":
        return float(2 * ring_bytes(params * 4, world_size))
    return 0.0


def summarize(ranks: list[dict], config: dict[str, Any]) -> dict[str, Any]:
    """Combine every rank's results into one summary per implementation."""
    meta = ranks[0]["_meta"]
    summary: dict[str, Any] = {}
    for name in config["impls"]:
        first = ranks[0][name]
        entry: dict[str, Any] = {"label": LABELS[name], "notes": first.get("notes", [])}
        summary[name] = entry
        if "skipped" in first:
            entry["skipped"] = first["skipped"]
            continue
        entry.update(_times(name, ranks))
        if meta["memory_measured"]:
            entry.update(_memory(name, ranks, len(first["step_s"])))
        entry["comm"] = _comm(name, ranks, config)
    # None (null in the JSON, "-" in the table) when torch's fully_shard was skipped or not run.
    reference = summary.get(TORCH_FULLY_SHARD, {}).get("step_ms", {}).get("median")
    cpu_reference = summary.get(TORCH_FULLY_SHARD, {}).get("cpu_ms", {}).get("median")
    for entry in summary.values():
        if "step_ms" in entry:
            entry["ratio_to_torch_fully_shard"] = _ratio(entry["step_ms"]["median"], reference)
            cpu = entry["cpu_ms"]
            cpu["ratio_to_torch_fully_shard"] = _ratio(cpu["median"], cpu_reference)
    return summary


def _times(name: str, ranks: list[dict]) -> dict[str, Any]:
    """Step time (a step is as slow as its slowest rank) and CPU time per step."""
    timed = range(len(ranks[0][name]["step_s"]))
    step_s = [max(rank[name]["step_s"][i] for rank in ranks) for i in timed]
    # CPU time is work, not waiting on the slowest rank: the mean over the ranks'
    # processes. None where ranks took none (threads of one process).
    cpu_median = None
    if all("cpu_s" in rank[name] for rank in ranks):
        cpu_s = [statistics.fmean(rank[name]["cpu_s"][i] for rank in ranks) for i in timed]
        cpu_median = statistics.median(cpu_s) * 1e3
    return {
        "step_ms": {k: v * 1e3 for k, v in quartiles(step_s).items()},
        "steps_timed": len(step_s),
        "cpu_ms": {"median": cpu_median},
    }


def _memory(name: str, ranks: list[dict], steps: int) -> dict[str, Any]:
    """Peak above each step's start (median and largest over steps, largest over ranks)
    and what stays allocated between steps."""
    peaks = [max(rank[name]["peak_above_start"][i] for rank in ranks) for i in range(steps)]
    memory = {
        "peak_above_step_start_bytes": int(statistics.median(peaks)),
        "peak_above_step_start_max_bytes": max(peaks),
        "kept_between_steps_bytes": max(rank[name]["kept"] for rank in ranks),
    }
    if "reserved_peak" in ranks[0][name]:
        memory["reserved_peak_bytes"] = max(rank[name]["reserved_peak"] for rank in ranks)
    return memory


def _comm(name: str, ranks: list[dict], config: dict[str, Any]) -> dict[str, Any]:
    """Collectives per step, bytes sent, and the least an implementation of its kind sends."""
    world_size = len(ranks)
    meta = ranks[0]["_meta"]
    first = ranks[0][name]
    comm_bytes = first["comm_bytes"]
    impl_strategy = None if world_size == 1 else strategy(name, config["reshard_after_forward"])
    if name in ("ddp", "local") or not config["mixed_precision"]:
        param_bytes = 4
    else:
        param_bytes = 2
    return {
        "counts": first["comm_counts"],
        "bytes": comm_bytes,
        "collectives_per_step": sum(first["comm_counts"].values()),
        "sent_bytes_per_rank": sent_per_rank(comm_bytes, world_size),
        "analytic_min_bytes": analytic_min_bytes(
            impl_strategy, meta["params"], meta["root_params"], world_size, param_bytes=param_bytes
        ),
    }


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value and reference else None


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / MB:.1f}"


def format_table(summary: dict[str, Any], memory_note: str) -> str:
    """The per-implementation table printed after a run."""
    header = (
        f"{'implementation':<20} {'median ms':>9} {'IQR ms':>15} {'vs torch fs':>11} "
        f"{'cpu ms':>8} {'kept MB':>8} {'peak+ MB':>8} {'sent MB':>8} {'min MB':>8} {'colls':>5}"
    )
    lines = [header, "-" * len(header)]
    for entry in summary.values():
        if "skipped" in entry:
            lines.append(f"{entry['label']:<20} skipped: {entry['skipped']}")
            continue
        ms = entry["step_ms"]
        ratio = entry.get("ratio_to_torch_fully_shard")
        cpu_ms = entry["cpu_ms"]["median"]
        comm = entry["comm"]
        line = (
            f"{entry['label']:<20} {ms['median']:9.1f} "
            f"{ms['q1']:7.1f}-{ms['q3']:<7.1f} "
            f"{(f'{ratio:.3f}' if ratio else '-'):>11} "
            f"{('-' if cpu_ms is None else f'{cpu_ms:.1f}'):>8} "
            f"{_mb(entry.get('kept_between_steps_bytes')):>8} "
            f"{_mb(entry.get('peak_above_step_start_bytes')):>8} "
            f"{_mb(comm['sent_bytes_per_rank']):>8} {_mb(comm['analytic_min_bytes']):>8} "
            f"{comm['collectives_per_step']:>5}"
        )
        if entry["notes"]:
            line += "  (" + ", ".join(entry["notes"]) + ")"
        lines.append(line)
    lines.append(
        "median/IQR: step time over all timed steps (slowest rank per step); vs torch fs: "
        "median / torch fully_shard's median;"
    )
    lines.append(
        "cpu: median CPU time of a rank's process (all its threads) per step, mean over ranks;"
    )
    lines.append(
        "kept: bytes per rank held between steps (after build and warm-up, less before the "
        "build); peak+: median per-step peak above the bytes live at step start;"
    )
    lines.append(
        "sent: bytes one rank sends per step (ring algorithms); min: analytic minimum; "
        "colls: collectives per step."
    )
    if memory_note:
        lines.append(f"memory: {memory_note}")
    return "\n".join(lines)
