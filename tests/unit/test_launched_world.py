"""Reading a launched world from the environment (torchrun's and srun's variables), and the
board through which its ranks tell one another of failures."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from reffsdp.testing import launched_world
from reffsdp.testing.launched_world import FaultBoard, LaunchedEnv, LaunchError, read_launched_env

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}


def test_no_launcher_no_launched_world():
    assert read_launched_env({"PATH": "/usr/bin"}) is None
    batch_script = {key: value for key, value in SRUN.items() if key != "SLURM_STEP_ID"}
    assert read_launched_env(batch_script) is None  # sbatch's own shell is not a rank


def test_torchrun_world():
    env = read_launched_env(TORCHRUN)
    assert env == LaunchedEnv("torchrun", 3, 4, 1, 2, "node0", 29500)
    assert env.nodes == 2


def test_torchrun_wins_over_srun_which_started_it():
    assert read_launched_env({**SRUN, **TORCHRUN}).launcher == "torchrun"


@pytest.mark.parametrize(
    "tasks, per_node",
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, 4),
        ({"SLURM_STEP_TASKS_PER_NODE": "4,4"}, 4),
        ({"SLURM_STEP_TASKS_PER_NODE": "", "SLURM_NTASKS_PER_NODE": "4"}, 4),
    ],
)
def test_srun_world(tasks, per_node):
    env = read_launched_env({**SRUN, **tasks})
    assert env == LaunchedEnv("srun", 5, 8, 1, per_node, "node0", 29500)
    assert env.nodes == 2


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"MASTER_ADDR": ""}, "srun started this process but MASTER_ADDR is not set (export"),
        ({"SLURM_STEP_TASKS_PER_NODE": "5,3"}, "tasks per node '5,3' differ between nodes"),
        ({"SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, "every node must hold as many ranks"),
        ({"SLURM_STEP_TASKS_PER_NODE": "four"}, "cannot read tasks per node from 'four'"),
        ({"SLURM_STEP_TASKS_PER_NODE": ""}, "neither SLURM_STEP_TASKS_PER_NODE nor"),
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not a whole number"),
    ],
)
def test_a_half_described_srun_world_is_refused(change, problem):
    with pytest.raises(LaunchError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        read_launched_env({**SRUN, **change})


def test_a_half_described_torchrun_world_is_refused():
    environment = {key: value for key, value in TORCHRUN.items() if key != "LOCAL_WORLD_SIZE"}
    with pytest.raises(LaunchError, match="LOCAL_WORLD_SIZE is not set"):
        read_launched_env(environment)


def _boards(world_size: int) -> list[FaultBoard]:
    store = dist.HashStore()
    return [FaultBoard(store, rank, world_size) for rank in range(world_size)]


def test_failures_name_each_rank_silent_ones_first_then_in_posting_order(monkeypatch):
    monkeypatch.setattr(launched_world, "SILENT_S", 0.3)
    boards = _boards(4)
    for board in boards:
        board.beat()
    boards[2].post("ValueError: planted")
    boards[1].post("RuntimeError: connection closed by peer")
    boards[3].finish()
    assert boards[0].failures(0.0) == {
        2: "ValueError: planted",
        1: "RuntimeError: connection closed by peer",
    }
    found = boards[1].failures(2.0)  # rank 0 neither posts nor beats any more
    assert list(found) == [0, 2, 1]
    assert found[0] == "ended without a word (killed?): no beat for 0.3 s"


def test_a_beating_peer_is_waited_for_and_not_called_gone(monkeypatch):
    monkeypatch.setattr(launched_world, "SILENT_S", 0.3)
    boards = _boards(2)
    boards[1].beat()
    assert boards[0].failures(0.0) == {}
    assert boards[0].silent() == []
