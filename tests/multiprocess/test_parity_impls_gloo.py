"""``python -m reffsdp.testing --impl NAME --backend gloo``: the implementation's name travels
to every rank process, which loads it there: torch's own FSDP passes both APIs on the 1-D
and HSDP meshes (CPU offload unsupported, with torch's message), and a fork that only the
command's folder can import (``tests/fork_impl.py``) is caught in the rank processes."""

from __future__ import annotations

import json

import pytest

import reffsdp.testing.__main__ as cli
from tests.multithread.test_parity_impls import NO_ACCELERATOR

pytestmark = pytest.mark.multiprocess


def _statuses(path) -> dict[str, tuple[str, str]]:
    document = json.loads(path.read_text())
    return {s["name"]: (s["status"], s["message"]) for s in document["scenarios"]}, document


@pytest.mark.timeout(600)
def test_torch_on_gloo_passes_both_apis_on_1d_and_hsdp(tmp_path, capsys):
    path = tmp_path / "parity.json"
    only = [
        "fully_shard/1d/bf16/mlp",
        "fully_shard/hsdp/fp32/mlp",
        "fully_shard/1d/offload/transformer",
        "wrapper/1d/bf16/mlp",
        "wrapper/hsdp/fp32/mlp",
    ]
    argv = ["--impl", "torch", "--backend", "gloo", "--json", str(path), "--allow-unsupported"]
    assert cli.main([*argv, *(arg for name in only for arg in ("--only", name))]) == 0
    out = capsys.readouterr().out
    assert "4 passed, 0 failed, 1 unsupported, 0 skipped in " in out
    statuses, document = _statuses(path)
    assert (document["impl"], document["backend"]) == ("torch", "gloo")
    assert statuses.pop("fully_shard/1d/offload/transformer") == (
        "unsupported",
        f"torch's fully_shard raised {NO_ACCELERATOR}",
    )
    assert {status for status, _ in statuses.values()} == {"passed"}, statuses


@pytest.mark.timeout(600)
def test_a_fork_importable_from_the_working_folder_is_caught_in_the_rank_processes(tmp_path):
    path = tmp_path / "parity.json"
    argv = ["--impl", "tests.fork_impl", "--backend", "gloo", "--world-size", "2"]
    argv += ["--only", "fully_shard/1d/reshard/mlp", "--only", "wrapper/1d/fp32/convnet"]
    assert cli.main([*argv, "--json", str(path)]) == 1
    statuses, document = _statuses(path)
    assert (document["impl"], document["impl_version"]) == ("tests.fork_impl", "0.1.0+fork")
    status, message = statuses["fully_shard/1d/reshard/mlp"]
    assert status == "failed" and message.startswith("gradients: "), message
    status, message = statuses["wrapper/1d/fp32/convnet"]
    assert status == "not_applicable", message
