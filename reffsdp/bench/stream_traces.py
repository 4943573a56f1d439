"""On CPU, ``--profile DIR`` also writes what a GPU run's streams would do: one step of each
reffsdp implementation run on logical CUDA streams (``reffsdp.testing.simulated_streams``),
on threaded ranks, laid out as a GPU would run it (see [Note: the simulated schedule] in
``reffsdp.testing.stream_trace``), one Chrome trace per implementation:
``DIR/streams-<implementation>.json``.

A torch profiler trace of a CPU run shows every collective in line with compute: the host
runs them one after the other. The simulated trace shows the overlap the stream rules allow
instead: all-gathers running while the previous block computes, reduce-scatters while
backward goes on. The simulation also checks those rules; a finding is printed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from reffsdp.testing import simulated_streams
from reffsdp.testing.logical_streams import start_trace
from reffsdp.testing.multithread import run_threaded

from .impls import LABELS, build, skip_reason
from .launch import PG_TIMEOUT
from .runner import WARMUP_STEPS, make_step

SIMULATED = ("reffsdp_fully_shard", "reffsdp_fsdp")  # the implementations on reffsdp's core


def write_stream_traces(config: dict[str, Any]) -> list[str]:
    """The paths written: one per reffsdp implementation of ``config`` that could run."""
    paths = []
    for name in config["impls"]:
        if name not in SIMULATED or skip_reason(name, config["options"]) is not None:
            continue
        with simulated_streams() as report:
            run_threaded(
                lambda rank, name=name: _traced_step(rank, name, config),
                config["world_size"],
                timeout_s=PG_TIMEOUT.total_seconds(),
            )
        path = os.path.join(config["profile_dir"], f"streams-{name}.json")
        report.write_trace(path)
        paths.append(path)
        if report.findings:
            print(f"{LABELS[name]}: stream hazards:\n{report.findings.describe()}")
    return paths


def _traced_step(rank: int, name: str, config: dict[str, Any]) -> None:
    """Build ``name``, warm it up, then trace one step."""
    options = config["options"]
    device = torch.device("cpu")
    model = build(name, options.workload.build(device), options)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = make_step(model, optim, options.workload.batch(rank, device), options.workload.loss_fn())
    for _ in range(WARMUP_STEPS):
        step()
    start_trace()
    step()
