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


@pytest.mark.timeout(300)
def test_a_planted_bug_on_gloo_is_reported_with_every_failing_ranks_numbers():
    """The failure path over gloo processes: after a failed check the ranks all-gather their
    messages and differences, and rank 0's result carries them."""
    from reffsdp.testing.parity_suite import SuiteOptions, iter_results
    from reffsdp.testing.suite_scenarios import all_specs

    (spec,) = [spec for spec in all_specs() if spec.name == "fully_shard/1d/reshard/mlp"]
    options = SuiteOptions(backend="gloo", world_size=2, steps=1)
    (result,) = iter_results([spec], options, "wrong gradient divide factor")
    assert result.status == "failed"
    first, *rest = result.message.splitlines()
    assert first.startswith("gradients: check_train_parity, step 0 after backward: grad of ")
    for rank in (0, 1):
        assert (
            f"check_train_parity, step 0 after backward: parity check failed on rank {rank}:"
            in (rest)
        ), rest
    assert result.max_grad_diff > 1e-3
    assert "AssertionError" in result.traceback
