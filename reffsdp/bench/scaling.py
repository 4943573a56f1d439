"""``--scaling``: how step time, memory and bytes grow with the model and the world.

Three tables:

1. model size (world 2): step time, kept and peak memory per rank, per implementation;
2. world size (2 and 4 ranks, on however many cores the machine has): the same, plus the
   bytes each rank sends;
3. world 8 ... 1024 on the fake process group (one process plays rank 0; collectives move
   no data, so no time is reported): bytes sent and memory kept per rank, measured against
   the analytic formulas. The fully sharded state (fp32 parameter shard and two AdamW
   states, gradients freed between steps) is ``12 * Ψ_pad / W`` bytes, Ψ_pad counting each
   parameter's dim 0 rounded up to a multiple of W.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from reffsdp.testing.expected_comms import padded_numel

from .impls import IMPLS, LABELS, Options, build, skip_reason, strategy
from .launch import heap_counter_preloaded, run_single_process
from .memory import HeapCounter, MemoryProbe
from .models import Workload, param_counts
from .report import MB, analytic_min_bytes, sent_per_rank
from .run import describe, run_benchmark, run_config
from .runner import make_step, prime

MODEL_SIZES = ("tiny", "small", "27m", "100m", "220m")
WORLD_SIZES = (2, 4)
WORLD_SIZE_MODEL = "small"
FAKE_WORLD_SIZES = tuple(2**k for k in range(3, 11))  # 8 ... 1024
FAKE_IMPLS = ("reffsdp_fully_shard", "torch_fully_shard")
DEFAULT_IMPLS = ("reffsdp_fully_shard", "torch_fully_shard")


def run_scaling(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """Run the three tables, printing each, and fill ``document`` as each row finishes (so
    an interrupted run still keeps the rows that did)."""
    impls = list(DEFAULT_IMPLS) if list(args.impl) == list(IMPLS) else list(args.impl)
    document.update(impls=impls, model_size=[], world_size=[])
    print(
        f"Scaling, {args.model}, {args.backend} on {args.device}; implementations: "
        + ", ".join(LABELS[n] for n in impls)
    )

    print("\n1. Model size, world size 2")
    rows = []
    for size in MODEL_SIZES:
        config = run_config(args, size=size, world_size=2, impl=impls, profile=None)
        summary, note, meta = run_benchmark(config)
        print("   " + describe(config, meta))
        document["model_size"].append({"size": size, "params": meta["params"], "results": summary})
        rows.append((size, meta["params"], summary))
    _print_rows(rows, impls, "size", lambda size, params: f"{size} {params / 1e6:.1f}M")

    print(f"\n2. World size, model {WORLD_SIZE_MODEL}")
    rows = []
    for world_size in WORLD_SIZES:
        config = run_config(
            args, size=WORLD_SIZE_MODEL, world_size=world_size, impl=impls, profile=None
        )
        summary, note, meta = run_benchmark(config)
        print("   " + describe(config, meta))
        document["world_size"].append({"world_size": world_size, "results": summary})
        rows.append((world_size, meta["params"], summary))
    _print_rows(rows, impls, "world", lambda world, params: f"{world}", sent=True)
    print(f"   memory: {note}")

    print(f"\n3. Fake process group, model {args.size}, rank 0 of W (no data moves, no time)")
    fake_config = {
        "workload": Workload(args.model, args.size),
        "impls": list(FAKE_IMPLS),
        "world_sizes": list(FAKE_WORLD_SIZES),
        "reshard_after_forward": args.reshard_after_forward,
    }
    with heap_counter_preloaded(True) as why:
        fake = run_single_process(run_fake_worlds, fake_config)
    if why:
        print(f"   memory: {why}")
    document["fake_process_group"] = fake
    _print_fake(fake)


def _print_rows(rows, impls, first: str, label, *, sent: bool = False) -> None:
    header = f"   {first:<12}"
    for name in impls:
        header += f" | {LABELS[name][:19]:<19} ms  kept MB  peak+ MB"
        if sent:
            header += "  sent MB"
    print(header)
    for key, params, summary in rows:
        line = f"   {label(key, params):<12}"
        for name in impls:
            entry = summary[name]
            if "skipped" in entry:
                line += f" | {'skipped':<42}"
                continue
            line += (
                f" | {entry['step_ms']['median']:19.1f}   "
                f"{entry.get('kept_between_steps_bytes', 0) / MB:7.1f}  "
                f"{entry.get('peak_above_step_start_bytes', 0) / MB:8.1f}"
            )
            if sent:
                line += f"  {entry['comm']['sent_bytes_per_rank'] / MB:7.1f}"
        print(line)


def _padded_numel(model: torch.nn.Module, world_size: int) -> int:
    """Ψ_pad: every parameter padded as ``fully_shard`` pads it for ``world_size`` ranks."""
    return sum(padded_numel(p.shape, world_size) for p in model.parameters())


def run_fake_worlds(config: dict[str, Any]) -> dict[str, Any]:
    """In one process: for each fake world size, shard, step, and count bytes and memory."""
    from reffsdp.testing.fake_pg import fake_process_group

    workload: Workload = config["workload"]
    device = torch.device("cpu")
    probe = MemoryProbe(device, HeapCounter.load())
    base = workload.build(device)
    params, root_params, largest_block = param_counts(base)
    batch = workload.batch(0, device)
    loss_fn = workload.loss_fn()
    fake = Options(
        workload,
        device,
        "fake",
        offload=False,
        mixed_precision=None,
        reshard_after_forward=config["reshard_after_forward"],
    )
    fake_strategy = strategy(config["impls"][0], fake.reshard_after_forward)
    skipped = {name: skip_reason(name, fake) for name in config["impls"]}
    names = [name for name, reason in skipped.items() if reason is None]
    rows = []
    for world_size in config["world_sizes"]:
        padded = _padded_numel(base, world_size)
        row: dict[str, Any] = {
            "world_size": world_size,
            "params": params,
            "padded_params": padded,
            "analytic_min_bytes": analytic_min_bytes(
                fake_strategy, params, root_params, world_size
            ),
            "analytic_kept_bytes": 12 * padded / world_size,
            "results": {},
        }
        with fake_process_group(world_size, rank=0):
            prime(names, fake, base)
            for name in names:
                measured = _measure_fake(name, base, fake, world_size, (batch, loss_fn, probe))
                row["results"][name] = measured
        rows.append(row)
    return {
        "model": workload.kind,
        "size": workload.size,
        "params": params,
        "root_params": root_params,
        "largest_block_params": largest_block,
        "strategy": fake_strategy,
        "rows": rows,
        "skipped": {name: reason for name, reason in skipped.items() if reason is not None},
    }


def _measure_fake(
    name: str,
    base: torch.nn.Module,
    fake: Options,
    world_size: int,
    workload: tuple[Any, Any, MemoryProbe],
) -> dict[str, Any]:
    """Memory kept and peak, and bytes sent, of rank 0 stepping ``name`` in the fake world
    of ``world_size`` entered (two warm-up steps first); ``workload``: batch, loss, probe."""
    batch, loss_fn, probe = workload
    from reffsdp.testing.comm_counter import CommCounter

    gc.collect()
    before = probe.current()
    model = build(name, base, fake)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = make_step(model, optim, batch, loss_fn)
    del model, optim  # the step holds them
    step()
    step()
    gc.collect()
    kept = probe.current() - before
    start = probe.start_step()
    step()
    peak = probe.peak() - start
    with CommCounter() as counter:
        step()
    comm_bytes = {k.value: v for k, v in counter.get_comm_bytes().items()}
    return {
        "kept_between_steps_bytes": kept if probe.available else None,
        "peak_above_step_start_bytes": peak if probe.available else None,
        "sent_bytes_per_rank": sent_per_rank(comm_bytes, world_size),
        "comm_bytes": comm_bytes,
    }


def _print_fake(fake: dict[str, Any]) -> None:
    for name, reason in fake["skipped"].items():
        print(f"   {LABELS[name]}: skipped: {reason}")
    names = list(fake["rows"][0]["results"])
    header = f"   {'W':>5} {'min MB':>8} {'12Ψpad/W MB':>11}"
    for name in names:
        header += f" | {LABELS[name][:19]:<19} sent MB  kept MB  peak+ MB"
    print(header)
    for row in fake["rows"]:
        line = (
            f"   {row['world_size']:>5} {row['analytic_min_bytes'] / MB:8.1f} "
            f"{row['analytic_kept_bytes'] / MB:11.2f}"
        )
        for name in names:
            entry = row["results"][name]
            kept, peak = entry["kept_between_steps_bytes"], entry["peak_above_step_start_bytes"]
            line += (
                f" | {'':<19} {entry['sent_bytes_per_rank'] / MB:7.1f}  "
                f"{(kept or 0) / MB:7.2f}  {(peak or 0) / MB:8.1f}"
            )
        print(line)
    if fake["strategy"] == "shard_grad_op":
        formula = "2Ψ(W-1)/W (no reshard after forward)"
    else:
        formula = "3Ψ(W-1)/W less the root's backward all-gather"
    print(
        f"   min: analytic bytes one rank sends per step, {formula}; "
        "12Ψpad/W: fp32 shard + 2 AdamW states per rank."
    )
