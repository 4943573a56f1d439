"""The benchmark and the FSDPTest harness under torchrun join the launched world instead of
spawning ranks: ``python -m reffsdp.bench`` prints one table and writes one JSON for the
launched world, and a test module run under torchrun runs each test on the launched ranks
(``launched_harness_cases.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


def _torchrun(tmp_path: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TORCHRUN, *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        env={"REFFSDP_BENCH_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.timeout(120)
def test_the_benchmark_under_torchrun_reports_once_for_the_launched_world(tmp_path):
    out = tmp_path / "bench.json"
    bench = ["-m", "reffsdp.bench", "--model", "mlp", "--size", "tiny", "--steps", "1"]
    bench += ["--rounds", "1", "--impl", "reffsdp_fully_shard", "--json", str(out)]
    result = _torchrun(tmp_path, *bench)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("implementation ") == 1, result.stdout  # rank 0's table only
    assert "gloo, 2 ranks on cpu" in result.stdout
    config = json.loads(out.read_text())["config"]
    launch = {key: config[key] for key in ("launcher", "world_size", "nodes", "ranks_per_node")}
    assert launch == {"launcher": "torchrun", "world_size": 2, "nodes": 1, "ranks_per_node": 2}


@pytest.mark.timeout(120)
def test_a_test_module_under_torchrun_runs_on_the_launched_ranks(tmp_path):
    cases = "tests/multiprocess/launched_harness_cases.py"
    result = _torchrun(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", cases)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]  # the planted failure
    assert output.count("1 failed, 2 passed, 1 skipped") == 2, output[-3000:]  # each rank
    assert output.count("needs 4 ranks, but torchrun launched 2") == 2
    assert "ValueError: planted failure on rank 1" in output
