"""One benchmark run, seen from the launching process: its configuration, its ranks, its
summary.

:func:`run_config` turns the command line's arguments into the plain data every rank
receives, :func:`run_benchmark` runs the ranks (:mod:`reffsdp.bench.launch`; each runs
:func:`reffsdp.bench.runner.run_rank`) and summarises what they measured, and
:func:`describe` says in one line what ran. The command line (:mod:`reffsdp.bench.cli`) and
the scaling tables (:mod:`reffsdp.bench.scaling`) both build on it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import torch

from reffsdp.testing.launched_world import LaunchedEnv

from .impls import IMPLS, Options
from .launch import heap_counter_preloaded, run_processes, run_threads
from .models import Workload
from .report import summarize
from .runner import run_rank


def run_config(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The plain-data description of one run that every rank receives."""
    values = {**vars(args), **overrides}
    launched = values.get("launched")
    impls = [name for name in IMPLS if name in values["impl"]]
    return {
        "options": Options(
            workload=Workload(values["model"], values["size"]),
            device=torch.device(values["device"]),
            backend=values["backend"],
            offload=values["offload"],
            mixed_precision=values["mixed_precision"],
            reshard_after_forward=values["reshard_after_forward"],
        ),
        "impls": impls,
        "steps": values["steps"],
        "rounds": values["rounds"],
        "profile_dir": values.get("profile"),
        "threads_share_heap": values["backend"] == "threaded",
        # for the report
        "world_size": values["world_size"],
        "launch": _launch(launched, values["world_size"]),
        "mixed_precision": values["mixed_precision"],
        "reshard_after_forward": values["reshard_after_forward"],
    }


def _launch(launched: LaunchedEnv | None, world_size: int) -> dict[str, Any]:
    """How the ranks came to be: ``spawn`` (this command started them), or the launcher
    whose world it joined, with its nodes and ranks per node."""
    if launched is None:
        return {"launcher": "spawn", "nodes": 1, "ranks_per_node": world_size}
    per_node = launched.local_world_size
    return {"launcher": launched.launcher, "nodes": launched.nodes, "ranks_per_node": per_node}


def run_benchmark(
    config: dict[str, Any], finished: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """Run one configuration; ``(summary, memory note, rank 0's meta)``.

    ``finished`` receives what rank 0 announced (a record per implementation built and per
    implementation and round timed), also when the run is interrupted.
    """
    options: Options = config["options"]
    world_size = config["world_size"]
    threaded = options.backend == "threaded"
    joined = config["launch"]["launcher"] != "spawn"
    wants_heap = options.device.type == "cpu" and not threaded and not joined
    with tempfile.TemporaryDirectory(prefix="reffsdp-bench-") as progress_dir:
        config = {**config, "progress_path": os.path.join(progress_dir, "progress.jsonl")}
        try:
            with heap_counter_preloaded(wants_heap) as why:
                if threaded:
                    ranks = run_threads(run_rank, world_size, config)
                    why = "threaded backend: ranks share one process heap, CPU memory not measured"
                else:
                    ranks = run_processes(run_rank, world_size, options.backend, config)
                    if joined:
                        why = "launched ranks: CPU memory not measured (the heap counter is "
                        why += "preloaded only into ranks this command spawns)"
        finally:
            if finished is not None:
                finished.extend(_records(config["progress_path"]))
    if options.device.type == "cuda":
        why = "CUDA caching allocator (max_memory_allocated)"
    elif not why:
        why = "process-wide heap bytes (LD_PRELOAD allocator counter)"
    return summarize(ranks, config), why, ranks[0]["_meta"]


def _records(path: str) -> list[dict[str, Any]]:
    """The records rank 0 appended to ``path`` (a last one cut short is left out)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as file:
        for line in file:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def describe(config: dict[str, Any], meta: dict[str, Any]) -> str:
    options: Options = config["options"]
    extras = []
    if options.mixed_precision:
        extras.append(f"mixed precision {options.mixed_precision}")
    if options.offload:
        extras.append("CPU offload")
    if not options.reshard_after_forward:
        extras.append("no reshard after forward")
    return (
        f"{options.workload.kind} {options.workload.size} ({meta['params'] / 1e6:.1f}M params, "
        f"root {meta['root_params'] / 1e6:.2f}M), {options.backend}, {config['world_size']} "
        f"ranks on {options.device.type}, {config['rounds']} rounds x {config['steps']} steps"
        + "".join(f", {e}" for e in extras)
        + f"; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
