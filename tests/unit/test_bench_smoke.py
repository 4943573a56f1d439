"""``python -m reffsdp.bench`` runs end to end on a tiny model and writes its JSON fields.

Not a timing test: it only checks that the command works and reports what it promises.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reffsdp.bench import impls
from reffsdp.bench.cli import parser
from reffsdp.bench.impls import Options, Skip, build, skip_reason, strategy
from reffsdp.bench.models import Workload
from reffsdp.bench.report import analytic_min_bytes, format_table, sent_per_rank, summarize
from tests.cli_signals import deadline_s, interrupt

ROOT = Path(__file__).resolve().parents[2]


def _run_bench(tmp_path, impls: list[str], *options: str) -> tuple[str, dict]:
    """Run the command on the tiny MLP from the repository root; (stdout, JSON document)."""
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "reffsdp.bench", "--model", "mlp", "--size", "tiny"]
    command += ["--steps", "1", "--json", str(out), "--impl", *impls, *options]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=110,
        env={"REFFSDP_BENCH_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(out.read_text())


def test_help_shows_every_default():
    help_text = parser().format_help()
    for action in parser()._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings
    assert "(default: 27m)" in help_text and "timed steps per round (default: 3)" in help_text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["pid", "group"])
def test_ctrl_c_ends_the_benchmark_and_its_rank_processes(tmp_path, how):
    """A line per implementation and round as it goes; Ctrl-C (SIGINT to the process, or to
    its process group) ends it at once, exit status 130, no traceback, no rank process left,
    and the JSON keeps what finished."""
    out = tmp_path / "bench.json"
    command = ["reffsdp.bench", "--model", "mlp", "--size", "tiny", "--rounds", "500"]
    command += ["--impl", "reffsdp_fully_shard", "ddp", "--json", str(out)]
    ended = interrupt(command, "round 1/500", how)
    assert ended.returncode == 130, ended.stderr
    assert ended.seconds < deadline_s()
    assert "Traceback" not in ended.stderr, ended.stderr
    assert ended.ranks_left == []
    assert "reffsdp fully_shard: built, 2 warm-up steps in " in ended.stdout
    document = json.loads(out.read_text())
    assert document["interrupted"] is True
    assert document["config"]["impls"] == ["reffsdp_fully_shard", "ddp"]
    rounds = [record for record in document["finished"] if "round" in record]
    assert rounds[0]["impl"] == "reffsdp_fully_shard" and len(rounds[0]["step_ms"]) == 3


@pytest.mark.timeout(120)
def test_bench_command_writes_every_field(tmp_path):
    impls = ["reffsdp_fully_shard", "torch_fully_shard", "ddp", "local"]
    stdout, document = _run_bench(tmp_path, impls, "--rounds", "2")
    assert "reffsdp fully_shard" in stdout
    for name in ("reffsdp fully_shard", "torch fully_shard", "DDP", "local (no comm)"):
        assert f"{name}: built, 2 warm-up steps in " in stdout
        for index in (1, 2):
            assert re.search(rf"round {index}/2  {re.escape(name)} +median [\d.]+ ms", stdout)
    assert document["interrupted"] is False

    config = document["config"]
    assert (config["model"], config["size"], config["world_size"]) == ("mlp", "tiny", 2)
    assert config["impls"] == impls
    results = document["results"]
    assert set(results) == set(impls)
    for entry in results.values():
        assert entry["steps_timed"] == 2
        assert 0 < entry["step_ms"]["min"] <= entry["step_ms"]["median"] <= entry["step_ms"]["max"]
        assert entry["ratio_to_torch_fully_shard"] > 0
        assert entry["cpu_ms"]["median"] > 0
        assert entry["cpu_ms"]["ratio_to_torch_fully_shard"] > 0
        assert entry["kept_between_steps_bytes"] > 0
        assert entry["peak_above_step_start_bytes"] > 0
        assert entry["comm"]["sent_bytes_per_rank"] >= entry["comm"]["analytic_min_bytes"]
    assert results["torch_fully_shard"]["ratio_to_torch_fully_shard"] == 1.0
    assert results["torch_fully_shard"]["cpu_ms"]["ratio_to_torch_fully_shard"] == 1.0
    assert "cpu ms" in stdout
    assert results["local"]["comm"]["collectives_per_step"] == 0
    # Sharded implementations send the analytic FULL_SHARD bytes, give or take padding.
    for name in ("reffsdp_fully_shard", "torch_fully_shard"):
        comm = results[name]["comm"]
        assert comm["sent_bytes_per_rank"] <= 1.1 * comm["analytic_min_bytes"]
    # fp32 AdamW keeps a parameter shard and two states: 12 bytes per parameter, / 2 ranks.
    kept = results["reffsdp_fully_shard"]["kept_between_steps_bytes"]
    assert kept >= 12 * config["params"] / 2
    assert "heap" in document["memory"]


@pytest.mark.timeout(120)
def test_bench_without_resharding_after_forward_sends_one_all_gather(tmp_path):
    """``--no-reshard-after-forward`` reaches every FSDP builder: each sends the
    SHARD_GRAD_OP minimum (forward all-gather, reduce-scatter), less than FULL_SHARD's."""
    impls = ["reffsdp_fully_shard", "torch_fully_shard", "reffsdp_fsdp"]
    stdout, document = _run_bench(tmp_path, impls, "--rounds", "1", "--no-reshard-after-forward")
    assert "no reshard after forward" in stdout

    config = document["config"]
    assert config["reshard_after_forward"] is False
    assert config["impls"] == impls
    sizes = (config["params"], config["root_params"], config["world_size"])
    minimum = analytic_min_bytes("shard_grad_op", *sizes)
    resharding = analytic_min_bytes("shard", *sizes)
    for name in impls:
        comm = document["results"][name]["comm"]
        assert comm["analytic_min_bytes"] == minimum, name
        assert minimum <= comm["sent_bytes_per_rank"] <= 1.1 * minimum, (name, comm)
        assert comm["sent_bytes_per_rank"] < resharding, (name, comm)


def test_runs_torch_cannot_do_are_skipped_with_the_reason():
    cpu = Options(Workload("mlp", "tiny"), torch.device("cpu"), "gloo", True, None)
    assert "offload" in skip_reason("torch_fsdp", cpu)
    assert skip_reason("reffsdp_fsdp", cpu) is None
    assert skip_reason("torch_fsdp", Options(cpu.workload, cpu.device, "gloo", False, None)) is None


def _rank_results(reason: str) -> dict:
    """One rank's raw results: reffsdp's fully_shard ran, torch's was skipped."""
    ran = {"notes": [], "step_s": [0.02, 0.01, 0.03], "comm_bytes": {}, "comm_counts": {}}
    return {
        "_meta": {"memory_measured": False, "params": 10, "root_params": 2},
        "reffsdp_fully_shard": ran,
        "torch_fully_shard": {"notes": [], "skipped": reason},
    }


def test_without_the_reference_module_torch_is_skipped_and_the_ratio_is_empty(monkeypatch):
    """Outside a source checkout torch's builders cannot be loaded: both torch rows are
    skipped with the reason, and the report has no ratio (null, "-") instead of failing."""
    monkeypatch.setattr(impls, "REFERENCE_MODULE", "tests.benchmarks.no_such_module")
    options = Options(Workload("mlp", "tiny"), torch.device("cpu"), "gloo", False, None)
    for name in ("torch_fully_shard", "torch_fsdp"):
        reason = skip_reason(name, options)
        assert "source checkout" in reason and "torch_reference.py" in reason, reason
        with pytest.raises(Skip, match="source checkout"):
            build(name, torch.nn.Linear(2, 2), options)
    assert skip_reason("reffsdp_fully_shard", options) is None
    assert skip_reason("ddp", options) is None
    # The reasons that do not depend on the checkout still come first.
    offload = Options(options.workload, options.device, "gloo", True, None)
    assert "offload" in skip_reason("torch_fsdp", offload)

    reason = skip_reason("torch_fully_shard", options)
    impls_run = ["reffsdp_fully_shard", "torch_fully_shard"]
    for config_impls in (impls_run, impls_run[:1]):  # torch's fully_shard skipped, not selected
        config = {"impls": config_impls, "mixed_precision": None, "reshard_after_forward": True}
        summary = summarize([_rank_results(reason), _rank_results(reason)], config)
        assert summary["reffsdp_fully_shard"]["ratio_to_torch_fully_shard"] is None
        assert (
            json.loads(json.dumps(summary))["reffsdp_fully_shard"]
            == (summary["reffsdp_fully_shard"])
        )
        lines = format_table(summary, "").splitlines()
        ours = next(line for line in lines if line.startswith("reffsdp fully_shard"))
        assert ours.split()[2:5] == ["20.0", "15.0-25.0", "-"], ours
        if "torch_fully_shard" in config_impls:
            assert f"torch fully_shard    skipped: {reason}" in lines


def test_cpu_time_is_the_median_step_of_the_mean_over_ranks():
    """Per step the mean of the ranks' process CPU times, then the median over steps; the
    ratio to torch's fully_shard. Threaded ranks record none: None in the summary, "-"."""

    def rank(cpu_ours: list[float] | None, cpu_torch: list[float] | None) -> dict:
        results = {"_meta": {"memory_measured": False, "params": 10, "root_params": 2}}
        for name, cpu_s in (("reffsdp_fully_shard", cpu_ours), ("torch_fully_shard", cpu_torch)):
            entry = {"notes": [], "step_s": [0.05, 0.05, 0.05], "comm_bytes": {}, "comm_counts": {}}
            if cpu_s is not None:
                entry["cpu_s"] = cpu_s
            results[name] = entry
        return results

    config = {
        "impls": ["reffsdp_fully_shard", "torch_fully_shard"],
        "mixed_precision": None,
        "reshard_after_forward": True,
    }
    # Per-step means: ours 0.02, 0.01, 0.03 (median 20 ms); torch's 0.04, 0.05, 0.03 (40 ms).
    ranks = [
        rank([0.01, 0.02, 0.02], [0.04, 0.06, 0.02]),
        rank([0.03, 0.0, 0.04], [0.04, 0.04, 0.04]),
    ]
    summary = summarize(ranks, config)
    ours = summary["reffsdp_fully_shard"]["cpu_ms"]
    torch_fs = summary["torch_fully_shard"]["cpu_ms"]
    assert ours["median"] == pytest.approx(20.0)
    assert torch_fs["median"] == pytest.approx(40.0)
    assert ours["ratio_to_torch_fully_shard"] == pytest.approx(0.5)
    assert torch_fs["ratio_to_torch_fully_shard"] == 1.0
    lines = format_table(summary, "").splitlines()
    assert "vs torch fs   cpu ms  kept MB" in lines[0], lines[0]
    row = next(line for line in lines if line.startswith("reffsdp fully_shard"))
    assert row.split()[5] == "20.0", row
    assert any(line.startswith("cpu: ") and "mean over ranks" in line for line in lines)

    threaded = summarize([rank(None, None), rank(None, None)], config)
    for name in config["impls"]:
        assert threaded[name]["cpu_ms"] == {"median": None, "ratio_to_torch_fully_shard": None}
    row = next(line for line in format_table(threaded, "").splitlines() if "reffsdp" in line)
    assert row.split()[5] == "-", row


def test_analytic_bytes():
    # FULL_SHARD: forward all-gather, backward all-gather of all but the root, reduce-scatter.
    assert analytic_min_bytes("shard", 100, 10, 4) == 0.75 * (400 + 360 + 400)
    assert analytic_min_bytes("allreduce", 100, 10, 4) == 2 * 0.75 * 400
    assert analytic_min_bytes(None, 100, 10, 4) == 0
    assert sent_per_rank({"all_gather": 400, "all_reduce": 400, "barrier": 0}, 4) == 900


def test_analytic_bytes_without_resharding_after_forward():
    # SHARD_GRAD_OP: one all-gather in forward, none in backward, reduce-scatter.
    assert analytic_min_bytes("shard_grad_op", 100, 10, 4) == 0.75 * (400 + 400)
    assert analytic_min_bytes("shard_grad_op", 100, 10, 4, param_bytes=2) == 0.75 * (200 + 400)
    for name in ("reffsdp_fully_shard", "torch_fully_shard", "reffsdp_fsdp", "torch_fsdp"):
        assert strategy(name, reshard_after_forward=False) == "shard_grad_op"
        assert strategy(name, reshard_after_forward=True) == "shard"
    assert strategy("ddp", reshard_after_forward=False) == "allreduce"
    assert strategy("local", reshard_after_forward=False) is None


def test_bytes_and_padding_follow_the_parity_suites_models():
    """The benchmark's bytes on the wire and its Ψ_pad are the parity suite's ring-bytes
    model and padded sizes (reffsdp.testing.expected_comms), exact on any world size."""
    from reffsdp.bench.scaling import _padded_numel
    from reffsdp.testing.expected_comms import padded_numel, ring_bytes

    sent = sent_per_rank({"all_gather": 300, "reduce_scatter": 300, "all_reduce": 300}, 3)
    assert sent == float(4 * ring_bytes(300, 3)) == 800.0
    assert analytic_min_bytes("shard_grad_op", 75, 0, 3) == float(ring_bytes(600, 3)) == 400.0
    model = torch.nn.Linear(3, 5)  # weight (5, 3), bias (5,): 8 rows each on 4 ranks
    assert _padded_numel(model, 4) == padded_numel((5, 3), 4) + padded_numel((5,), 4) == 32


def _usage_error(argv: list[str], capsys) -> str:
    """What the command line says refusing ``argv`` before anything runs (it must exit with
    status 2, as the parity suite's does for bad arguments)."""
    from reffsdp.bench.cli import resolve

    with pytest.raises(SystemExit) as exit_info:
        resolve(parser().parse_args(argv))
    assert exit_info.value.code == 2, exit_info.value.code
    return capsys.readouterr().err


def test_range_errors_are_usage_errors(capsys):
    for flag in ("--world-size", "--steps", "--rounds"):
        for value in ("0", "-1"):
            error = _usage_error([flag, value], capsys)
            assert f"argument {flag}: must be at least 1, got {value}" in error


def test_outputs_that_cannot_be_written_are_refused_before_the_run(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv, problem in [
        (["--json", str(a_file / "b.json")], f"{a_file} is not a folder"),
        (["--json", str(tmp_path)], "is a folder; give a file name you can write"),
        (["--profile", str(a_file)], "is not a folder; give a folder you can write"),
        (["--profile", str(a_file / "traces")], f"{a_file} is not a folder"),
    ]:
        assert problem in _usage_error(argv, capsys), argv
    # Folders that do not exist yet are made when the results are written.
    from reffsdp.bench.cli import resolve

    fine = ["--json", str(tmp_path / "new" / "b.json"), "--profile", str(tmp_path / "traces")]
    resolve(parser().parse_args(fine))
    assert not (tmp_path / "new").exists()  # nothing written by the check


def test_under_a_launcher_the_world_comes_from_it(monkeypatch, capsys):
    from reffsdp.bench.cli import resolve

    launched = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    launched.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for key, value in launched.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = resolve(parser().parse_args([]))
    assert (args.backend, args.device, args.world_size) == ("gloo", "cpu", 4)
    for argv, problem in [
        (["--world-size", "2"], "--world-size 2 conflicts with the launched world: torchrun"),
        (["--backend", "threaded"], "--backend threaded conflicts with the launched world"),
        (["--scaling"], "--scaling starts worlds of several sizes itself"),
    ]:
        assert problem in _usage_error(argv, capsys)
