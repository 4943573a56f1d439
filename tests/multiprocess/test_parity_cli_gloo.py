"""``python -m reffsdp.testing --backend gloo`` stops when asked: Ctrl-C (SIGINT to the
process, or to its process group) ends it at once with exit status 130, no traceback and
no rank process left running, and the JSON keeps the scenarios that finished."""

import json

import pytest

from tests.cli_signals import deadline_s, interrupt

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["pid", "group"])
def test_ctrl_c_ends_a_gloo_run_and_its_rank_processes(tmp_path, how):
    path = tmp_path / "parity.json"
    command = ["reffsdp.testing", "--backend", "gloo", "--world-size", "2", "--mesh", "1d"]
    ended = interrupt([*command, "--json", str(path)], "[1/", how)
    assert ended.returncode == 130, ended.stderr
    assert ended.seconds < deadline_s()
    assert "Traceback" not in ended.stderr, ended.stderr
    assert ended.ranks_left == []
    document = json.loads(path.read_text())
    assert document["interrupted"] is True
    assert document["scenarios"][0]["status"] == "passed"
