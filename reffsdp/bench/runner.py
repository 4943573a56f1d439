"""One rank's part of a benchmark run: build every implementation, time them in
interleaved rounds, then count their bytes and the memory each keeps.

[Note: what is measured, and when]
1. Prime the process (see :func:`prime`). Build each implementation, in turn, from a deep
   copy of the same model and run its two warm-up steps (not recorded; optimizer state
   exists afterwards). "Kept between steps" is what the process holds after that less what
   it held before the build: parameters, shards, optimizer state, and buffers the
   implementation caches between steps.
2. ``rounds`` rounds; each runs every implementation for ``steps`` steps, starting with a
   different one every round, after a barrier. Per step: wall time (CUDA synchronized), the
   CPU time of the rank's process (every thread: the compute thread and the backend's
   workers; not taken with the threaded backend, whose ranks share one process) and the
   memory peak above the bytes live at the step's start (the peak is reset there).
3. One more step per implementation under a collective counter (its dispatch-mode overhead
   never reaches a timed step): collectives and their bytes per step.
4. With a profile directory: one more round under ``torch.profiler``.

Rank 0 prints a line as each implementation is built and as each finishes a round (see
:func:`announce`), so a run of minutes shows where it is.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from reffsdp.core.profiling import phase
from reffsdp.testing.comm_counter import CommCounter

from .impls import LABELS, Options, Skip, build, notes
from .memory import HeapCounter, MemoryProbe
from .models import param_counts

WARMUP_STEPS = 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(
    model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor, loss_fn: Callable
) -> Callable[[], None]:
    def step() -> None:
        loss = loss_fn(model, batch)
        loss.backward()
        with phase("optimizer"):
            optim.step()
            optim.zero_grad(set_to_none=True)

    return step


def prime(names: list[str], options: Options, base: nn.Module) -> None:
    """Build each implementation of ``base`` and run one step, then drop it.

    The first implementation to run in a process pays for one-time state (lazily built
    kernels, dispatch and sharding caches keyed by shapes: 10-20 MB on CPU); priming with
    the same model keeps that out of every implementation's "kept between steps".
    """
    batch = options.workload.batch(0, options.device)
    for name in names:
        try:
            model = build(name, base, options)
        except Skip:
            continue
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        make_step(model, optim, batch, options.workload.loss_fn())()
        del model, optim
    gc.collect()


def announce(rank: int, config: dict[str, Any], line: str, record: dict[str, Any]) -> None:
    """On rank 0: append ``record`` to ``config["progress_path"]`` (when set), where the
    launching process finds what finished if the run is interrupted, then print ``line``.
    In that order: whoever reads the line and stops the run finds the record kept (the
    line first, a stop in between lost it)."""
    if rank != 0:
        return
    path = config.get("progress_path")
    if path:
        with open(path, "a") as file:
            file.write(json.dumps(record) + "\n")
    print(line, flush=True)


def run_rank(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Benchmark every implementation in ``config["impls"]`` on this rank; the results.

    The default process group is already initialized. ``config`` is plain data (see
    ``run.run_config``) so it crosses process boundaries.
    """
    options: Options = config["options"]
    if options.device.type == "cuda" and options.device.index is None:
        # This rank's GPU, by index: DDP and torch's wrapper want it explicit.
        options = dataclasses.replace(
            options, device=torch.device("cuda", torch.cuda.current_device())
        )
    shared_heap = config["threads_share_heap"]
    # Threaded ranks share one process: its CPU time is not any one rank's.
    me = _Rank(
        rank,
        config,
        options.device,
        MemoryProbe(options.device, None if shared_heap else HeapCounter.load()),
        times_cpu=not shared_heap,
    )
    base = options.workload.build(me.device)
    total, root, largest_block = param_counts(base)
    workload = (options.workload.batch(rank, me.device), options.workload.loss_fn())
    prime(config["impls"], options, base)

    results: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], None]] = {}
    for name in config["impls"]:
        results[name] = {"notes": notes(name, options)}
        step = _build_and_warm_up(me, name, options, base, workload, results[name])
        if step is not None:
            steps[name] = step
    del base

    for round_index in range(config["rounds"]):
        _time_round(me, round_index, steps, results)
    for name, step in steps.items():
        results[name].update(_comms_of_a_step(me, step))
    if config.get("profile_dir"):
        _profile(rank, list(steps), steps, config, me.device)

    results["_meta"] = {
        "memory_measured": me.probe.available,
        "params": total,
        "root_params": root,
        "largest_block_params": largest_block,
    }
    return results


@dataclasses.dataclass
class _Rank:
    """This rank of a benchmark run, as its measuring steps see it."""

    rank: int
    config: dict[str, Any]
    device: torch.device
    probe: MemoryProbe
    times_cpu: bool


def _build_and_warm_up(
    me: _Rank,
    name: str,
    options: Options,
    base: torch.nn.Module,
    workload: tuple[Any, Any],
    entry: dict[str, Any],
) -> Callable[[], None] | None:
    """Build ``name`` from ``base`` and warm it up; its step, or ``None`` when it is skipped.
    ``entry`` gets the memory kept and the lists the timed rounds fill."""
    gc.collect()
    before = me.probe.current()
    built_at = time.perf_counter()
    try:
        model = build(name, base, options)
    except Skip as skip:
        entry["skipped"] = str(skip)
        announce(me.rank, me.config, f"{LABELS[name]}: skipped: {skip}", {"impl": name})
        return None
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = make_step(model, optim, *workload)
    del model, optim  # the step holds them
    for _ in range(WARMUP_STEPS):
        step()
    _sync(me.device)
    dist.barrier()
    gc.collect()
    entry["kept"] = me.probe.current() - before
    seconds = time.perf_counter() - built_at
    announce(
        me.rank,
        me.config,
        f"{LABELS[name]}: built, {WARMUP_STEPS} warm-up steps in {seconds:.1f} s",
        {"impl": name, "built_s": seconds},
    )
    entry.update(step_s=[], peak_above_start=[], live_at_start=[])
    if me.times_cpu:
        entry["cpu_s"] = []
    return step


def _time_round(
    me: _Rank,
    round_index: int,
    steps: dict[str, Callable[[], None]],
    results: dict[str, dict[str, Any]],
) -> None:
    """Time ``config["steps"]`` steps of each implementation, starting one further along
    the list each round, so that none is always first."""
    names = list(steps)
    shift = round_index % max(1, len(names))
    count = me.config["steps"]
    for name in names[shift:] + names[:shift]:
        entry = results[name]
        dist.barrier()
        for _ in range(count):
            start_bytes = me.probe.start_step()
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[name]()
            _sync(me.device)
            entry["step_s"].append(time.perf_counter() - start)
            if me.times_cpu:
                entry["cpu_s"].append(time.process_time() - start_cpu)
            entry["peak_above_start"].append(me.probe.peak() - start_bytes)
            entry["live_at_start"].append(start_bytes)
            reserved = me.probe.reserved_peak()
            if reserved is not None:
                entry["reserved_peak"] = max(entry.get("reserved_peak", 0), reserved)
        _announce_round(me.rank, me.config, name, round_index, entry["step_s"][-count:])


def _comms_of_a_step(me: _Rank, step: Callable[[], None]) -> dict[str, Any]:
    """The collectives one more step issues, counted and in bytes."""
    dist.barrier()
    with CommCounter() as counter:
        step()
    _sync(me.device)
    return {
        "comm_counts": {k.value: v for k, v in counter.get_comm_counts().items()},
        "comm_bytes": {k.value: v for k, v in counter.get_comm_bytes().items()},
    }


def _announce_round(
    rank: int, config: dict[str, Any], name: str, round_index: int, step_s: list[float]
) -> None:
    median_ms = statistics.median(step_s) * 1e3
    announce(
        rank,
        config,
        f"round {round_index + 1}/{config['rounds']}  {LABELS[name]:<20} median "
        f"{median_ms:.1f} ms over {len(step_s)} steps (rank 0)",
        {"impl": name, "round": round_index + 1, "step_ms": [s * 1e3 for s in step_s]},
    )


def _profile(
    rank: int,
    names: list[str],
    steps: dict[str, Callable[[], None]],
    config: dict[str, Any],
    device: torch.device,
) -> None:
    """One more round under ``torch.profiler``; a Chrome trace per rank in the directory."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(config["profile_dir"], exist_ok=True)
    with torch.profiler.profile(activities=activities) as profiler:
        for name in names:
            dist.barrier()
            for index in range(config["steps"]):
                with torch.profiler.record_function(f"{name} step {index}"):
                    steps[name]()
            _sync(device)
    profiler.export_chrome_trace(os.path.join(config["profile_dir"], f"rank{rank}.json"))
