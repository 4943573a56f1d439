"""``python -m reffsdp.swap`` runs a trainer written against torch's FSDP on reffsdp without
an edit: ``torch_fsdp_trainer.py`` (which imports only ``torch.distributed.fsdp``) trains
with both APIs on 2 gloo ranks, as a script over ranks set up by hand and as a module under
torchrun; its modules are reffsdp's, its ``isinstance`` checks find them, and its losses and
parameters equal those of the same trainer on torch's FSDP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "tests/multiprocess/torch_fsdp_trainer.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "SLURM_")


def _environment(**extra: str) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
    return {**environment, **extra}


def _torchrun(*command: str) -> str:
    result = subprocess.run(
        [*TORCHRUN, *command], cwd=ROOT, env=_environment(), capture_output=True, text=True,
        timeout=100,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _two_ranks_by_hand(out: Path) -> list[str]:
    """The trainer as a script under the swap, on two processes given their ranks here."""
    port, ranks = str(_free_port()), []
    for rank in range(2):
        environment = _environment(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=port)  # fmt: skip
        command = [sys.executable, "-m", "reffsdp.swap", TRAINER, "--out", str(out)]
        ranks.append(
            subprocess.Popen(
                command, cwd=ROOT, env=environment, stderr=subprocess.PIPE, text=True
            )  # fmt: skip
        )
    errors = [rank.communicate(timeout=100)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], errors
    return errors


def _assert_same_training(ours: dict, torchs: dict) -> None:
    for api in ("fully_shard", "wrapper"):
        assert ours[api]["recognised"] == torchs[api]["recognised"] == 3, api
        for key in ("losses", "params"):
            torch.testing.assert_close(ours[api][key], torchs[api][key], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(200)
def test_an_unmodified_torch_fsdp_trainer_trains_on_reffsdp_with_torchs_results(tmp_path):
    _torchrun(TRAINER, "--out", str(tmp_path / "torch.json"))
    torchs = json.loads((tmp_path / "torch.json").read_text())
    assert torchs["fully_shard"]["class"].startswith("torch.distributed.fsdp")
    assert torchs["wrapper"]["class"].startswith("torch.distributed.fsdp")

    errors = _two_ranks_by_hand(tmp_path / "script.json")
    assert all(error.count("reffsdp.swap: ") == 1 for error in errors), errors  # said once
    module = TRAINER.removesuffix(".py").replace("/", ".")
    stderr = _torchrun("-m", "reffsdp.swap", "-m", module, "--out", str(tmp_path / "module.json"))
    assert stderr.count("reffsdp.swap: ") == 2  # once per rank
    for name in ("script.json", "module.json"):
        ours = json.loads((tmp_path / name).read_text())
        assert ours["fully_shard"]["class"].startswith("reffsdp."), name
        assert ours["wrapper"]["class"].startswith("reffsdp"), name
        _assert_same_training(ours, torchs)
