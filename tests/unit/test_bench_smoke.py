"""``python -m reffsdp.bench`` runs end to end on a tiny model and writes its JSON fields.

Not a timing test: it only checks that the command works and reports what it promises.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reffsdp.bench.impls import Options, skip_reason
from reffsdp.bench.models import Workload
from reffsdp.bench.report import analytic_min_bytes, sent_per_rank

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_bench_command_writes_every_field(tmp_path):
    out = tmp_path / "bench.json"
    impls = ["reffsdp_fully_shard", "torch_fully_shard", "ddp", "local"]
    command = [sys.executable, "-m", "reffsdp.bench", "--model", "mlp", "--size", "tiny"]
    command += ["--steps", "1", "--rounds", "2", "--json", str(out), "--impl", *impls]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=110,
        env={"REFFSDP_BENCH_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reffsdp fully_shard" in result.stdout

    document = json.loads(out.read_text())
    config = document["config"]
    assert (config["model"], config["size"], config["world_size"]) == ("mlp", "tiny", 2)
    assert config["impls"] == impls
    results = document["results"]
    assert set(results) == set(impls)
    for entry in results.values():
        assert entry["steps_timed"] == 2
        assert 0 < entry["step_ms"]["min"] <= entry["step_ms"]["median"] <= entry["step_ms"]["max"]
        assert entry["ratio_to_torch_fully_shard"] > 0
        assert entry["kept_between_steps_bytes"] > 0
        assert entry["peak_above_step_start_bytes"] > 0
        assert entry["comm"]["sent_bytes_per_rank"] >= entry["comm"]["analytic_min_bytes"]
    assert results["torch_fully_shard"]["ratio_to_torch_fully_shard"] == 1.0
    assert results["local"]["comm"]["collectives_per_step"] == 0
    # Sharded implementations send the analytic FULL_SHARD bytes, give or take padding.
    for name in ("reffsdp_fully_shard", "torch_fully_shard"):
        comm = results[name]["comm"]
        assert comm["sent_bytes_per_rank"] <= 1.1 * comm["analytic_min_bytes"]
    # fp32 AdamW keeps a parameter shard and two states: 12 bytes per parameter, / 2 ranks.
    kept = results["reffsdp_fully_shard"]["kept_between_steps_bytes"]
    assert kept >= 12 * config["params"] / 2
    assert "heap" in document["memory"]


def test_runs_torch_cannot_do_are_skipped_with_the_reason():
    cpu = Options(Workload("mlp", "tiny"), torch.device("cpu"), "gloo", True, None)
    assert "offload" in skip_reason("torch_fsdp", cpu)
    assert skip_reason("reffsdp_fsdp", cpu) is None
    assert skip_reason("torch_fsdp", Options(cpu.workload, cpu.device, "gloo", False, None)) is None


def test_analytic_bytes():
    # FULL_SHARD: forward all-gather, backward all-gather of all but the root, reduce-scatter.
    assert analytic_min_bytes("shard", 100, 10, 4) == 0.75 * (400 + 360 + 400)
    assert analytic_min_bytes("allreduce", 100, 10, 4) == 2 * 0.75 * 400
    assert analytic_min_bytes(None, 100, 10, 4) == 0
    assert sent_per_rank({"all_gather": 400, "all_reduce": 400, "barrier": 0}, 4) == 900
