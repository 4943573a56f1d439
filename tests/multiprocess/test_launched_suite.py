"""``python -m reffsdp.testing`` under a launcher joins the launched world instead of
spawning ranks: two torchrun agents on 127.0.0.1 as two simulated nodes of two ranks each
(HSDP replicates across them, shards inside each), srun's variables over four local
processes, and a worker killed mid-run, which ends the whole launch with a report that
names it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SELECTION = ["--only", "fully_shard/hsdp/fp32/*", "--only", "wrapper/hsdp/fp32/*"]
SELECTION += ["--only", "fully_shard/1d/reshard/*"]
# A launcher's variables this test's own environment may hold (under torchrun or srun).
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "SLURM_")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _agents(port: int, suite_args: list[str], logs: Path) -> list[subprocess.Popen]:
    """Two torchrun agents, each a simulated node of two workers, each writing to a log."""
    command = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "reffsdp.testing", *suite_args]
    agents = []
    for node in range(2):
        with open(logs / f"agent{node}.log", "w") as log:
            agents.append(subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    return agents


def _finish(agents: list[subprocess.Popen], logs: Path, timeout_s: float) -> tuple[list, str]:
    """The agents' exit codes and their output, once both ended (killed after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            agent.kill()
            codes.append(None)
    return codes, _output(logs)


def _output(logs: Path) -> str:
    return "".join(path.read_text() for path in sorted(logs.glob("agent*.log")))


@pytest.mark.timeout(240)
def test_two_torchrun_agents_run_the_suite_as_two_nodes(tmp_path):
    report = tmp_path / "parity.json"
    agents = _agents(_free_port(), [*SELECTION, "--json", str(report)], tmp_path)
    codes, output = _finish(agents, tmp_path, 200)
    assert codes == [0, 0], output[-3000:]
    assert output.count("3 passed, 0 failed, 0 skipped") == 1, output  # rank 0 alone
    assert output.count("[1/3] PASS") == 1
    document = json.loads(report.read_text())
    launch = {key: document[key] for key in ("launcher", "world_size", "nodes", "ranks_per_node")}
    assert launch == {"launcher": "torchrun", "world_size": 4, "nodes": 2, "ranks_per_node": 2}
    assert document["summary"]["passed"] == 3
    hsdp = [s for s in document["scenarios"] if s["mesh"] == "hsdp"]
    assert {s["api"] for s in hsdp} == {"fully_shard", "wrapper"}
    assert all(s["counts"]["all_reduce"] > 0 for s in hsdp)  # replicas: across the nodes


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _global_rank(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(item[5:]) for item in environ if item.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _wait_for(condition, timeout_s: float, what: str, logs: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout_s} s:\n{_output(logs)[-3000:]}")


def _workers(agent: subprocess.Popen) -> dict[int, int]:
    """The agent's workers, pid -> global rank."""
    workers = {pid: _global_rank(pid) for pid in _children(agent.pid)}
    return {pid: rank for pid, rank in workers.items() if rank is not None}


@pytest.mark.timeout(240)
def test_a_killed_worker_ends_the_whole_launch_and_is_named(tmp_path):
    report = tmp_path / "parity.json"
    suite = ["--mesh", "hsdp", "--timeout", "60", "--json", str(report)]
    agents = _agents(_free_port(), suite, tmp_path)
    try:
        workers = _wait_for(lambda: len(_workers(agents[1])) == 2 and _workers(agents[1]),
                            120, "workers", tmp_path)  # fmt: skip
        _wait_for(lambda: "[1/" in _output(tmp_path), 120, "finished scenario", tmp_path)
        victim, killed = max(workers.items(), key=lambda item: item[1])  # never rank 0
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        codes, output = _finish(agents, tmp_path, 120)
    finally:
        for agent in agents:
            agent.kill()
    assert time.monotonic() - start < 90, output[-3000:]
    assert None not in codes and 0 not in codes, output[-3000:]
    assert re.search(rf"rank\s*:?\s*{killed}\b", output), output[-5000:]
    if report.stat().st_size:  # rank 0 lived on: its report names the rank that went
        document = json.loads(report.read_text())
        failed = [s["message"] for s in document["scenarios"] if s["status"] == "failed"]
        assert any(f"rank {killed}" in message for message in failed), failed


@pytest.mark.timeout(240)
def test_srun_tasks_join_as_two_nodes(tmp_path):
    """What srun gives each of its tasks, set here for four local processes."""
    report, port = tmp_path / "parity.json", _free_port()
    command = [sys.executable, "-m", "reffsdp.testing", "--only", "fully_shard/hsdp/fp32/*"]
    tasks = []
    for rank in range(4):
        environment = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
        environment.update(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="4",
            SLURM_LOCALID=str(rank % 2),
            SLURM_STEP_ID="0",
            SLURM_STEP_TASKS_PER_NODE="2(x2)",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        with open(tmp_path / f"task{rank}.log", "w") as log:
            tasks.append(
                subprocess.Popen(
                    [*command, "--json", str(report)],
                    cwd=ROOT,
                    env=environment,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [task.wait(timeout=200) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    logs = [(tmp_path / f"task{rank}.log").read_text() for rank in range(4)]
    assert codes == [0, 0, 0, 0], "\n".join(logs)[-3000:]
    assert "1 passed, 0 failed, 0 skipped" in logs[0]
    assert not any(logs[1:]), logs[1:]  # rank 0 alone prints
    document = json.loads(report.read_text())
    launch = {key: document[key] for key in ("launcher", "world_size", "nodes", "ranks_per_node")}
    assert launch == {"launcher": "srun", "world_size": 4, "nodes": 2, "ranks_per_node": 2}
    assert document["scenarios"][0]["status"] == "passed"
