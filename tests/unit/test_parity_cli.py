"""The parity suite's command line (``python -m reffsdp.testing``) and its reports.

A stand-in engine, installed over ``reffsdp.testing.parity_suite``'s functions for the
length of a test, returns results (of the engine's own types) chosen by each test, so these
tests are fast and check only what the command line does with them: arguments, live lines,
table, JSON, JUnit XML, exit status.
"""

from __future__ import annotations

import fnmatch
import io
import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from reffsdp.testing import __main__ as cli
from reffsdp.testing import parity_suite, report
from tests.cli_signals import deadline_s, interrupt

ROOT = Path(__file__).resolve().parents[2]
COUNTS = {"all_gather": 4.0, "reduce_scatter": 4.0, "all_reduce": 0.0}


# --- the stand-in engine: the real result types, results chosen by each test -------------

SuiteOptions = parity_suite.SuiteOptions
ScenarioInfo = parity_suite.ScenarioInfo
ScenarioResult = parity_suite.ScenarioResult
SelfTestResult = parity_suite.SelfTestResult


def result(name: str, status: str = "passed", message: str = "", **fields) -> ScenarioResult:
    api, mesh, feature, model = name.split("/")
    values = dict(
        world_size=4,
        steps=3,
        max_loss_diff=0.0,
        max_grad_diff=1.5e-7,
        max_param_diff=2e-7,
        atol=1e-5,
        rtol=1e-5,
        counts=dict(COUNTS),
        expected_counts=dict(COUNTS),
        bytes_per_step=4096,
        min_bytes_per_step=3072,
        seconds=1.25,
    )
    if status == "skipped":
        values.update(max_loss_diff=None, max_grad_diff=None, max_param_diff=None, counts={})
    values.update(fields)
    return ScenarioResult(name, api, mesh, feature, model, status, message, **values)


class StandInEngine:
    """list_scenarios / iter_suite / list_self_test / iter_self_test over results a test
    sets."""

    def __init__(self) -> None:
        self.results = [
            result("fully_shard/1d/fp32/mlp"),
            result("fully_shard/hsdp/bf16/mlp"),
            result("wrapper/3d/fp32/mlp", "skipped", "needs 8 ranks, the gloo world has 4"),
        ]
        self.bugs = [
            SelfTestResult("wrong gradient divide factor", "fully_shard", True, "grad 0.5", 1.0),
            SelfTestResult("reshard skipped", "wrapper", True, "all_gather 2/4", 0.5),
        ]
        self.options: list[SuiteOptions] = []
        self.crash_after: int | None = None
        self.skipped_first = False  # as rank processes report them

    def list_scenarios(self, options: SuiteOptions) -> list[ScenarioInfo]:
        self.options.append(options)
        return [
            ScenarioInfo(r.name, r.api, r.mesh, r.feature, r.model, r.world_size)
            for r in self.results
            if self._selected(r.name, r.api, r.mesh, options)
        ]

    @staticmethod
    def _selected(name: str, api: str, mesh: str, options: SuiteOptions) -> bool:
        return (
            (not options.api or api in options.api)
            and (not options.mesh or mesh in options.mesh)
            and (not options.only or any(fnmatch.fnmatch(name, g) for g in options.only))
            and not any(fnmatch.fnmatch(name, g) for g in options.exclude)
        )

    def iter_suite(self, options: SuiteOptions) -> Iterator[ScenarioResult]:
        self.options.append(options)
        chosen = [r for r in self.results if self._selected(r.name, r.api, r.mesh, options)]
        if self.skipped_first:
            chosen.sort(key=lambda r: r.status != "skipped")
        for index, res in enumerate(chosen):
            if index == self.crash_after:
                raise RuntimeError("rank 2 lost its process group")
            yield res

    def list_self_test(self, options: SuiteOptions) -> list[tuple[str, str]]:
        self.options.append(options)
        return [(bug.bug, bug.api) for bug in self.bugs]

    def iter_self_test(self, options: SuiteOptions) -> Iterator[SelfTestResult]:
        self.options.append(options)
        yield from self.bugs


@pytest.fixture
def engine(monkeypatch):
    """The stand-in, installed where the command line looks for the engine."""
    stand_in = StandInEngine()
    for name in ("list_scenarios", "iter_suite", "list_self_test", "iter_self_test"):
        monkeypatch.setattr(parity_suite, name, getattr(stand_in, name), raising=False)
    return stand_in


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# --- arguments ----------------------------------------------------------------------------


def test_list_prints_the_selected_names(engine, capsys):
    assert cli.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == [r.name for r in engine.results]
    assert cli.main(["--list", "--api", "fully_shard", "--exclude", "*/1d/*"]) == 0
    assert capsys.readouterr().out.split() == ["fully_shard/hsdp/bf16/mlp"]


def test_api_naive_lists_the_two_naive_scenarios_of_the_real_engine(capsys):
    assert cli.main(["--list", "--api", "naive"]) == 0
    assert capsys.readouterr().out.split() == ["naive/1d/fp32/mlp", "naive/1d/accum/transformer"]
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out.split()
    assert len(out) == 66 and out[-2:] == ["naive/1d/fp32/mlp", "naive/1d/accum/transformer"]


def test_defaults_and_filters_reach_the_engine_as_options(engine):
    assert cli.main(["--list"]) == 0
    assert engine.options[-1] == SuiteOptions()  # the threaded backend on CPU, 4 ranks
    argv = ["--list", "--api", "wrapper", "--api", "fully_shard", "--api", "wrapper"]
    argv += ["--mesh", "hsdp", "--only", "*/bf16/*", "--only", "*mlp", "--exclude", "x*"]
    argv += ["--world-size", "2", "--steps", "5", "--seed", "7", "--backend", "gloo"]
    assert cli.main(argv) == 0
    assert engine.options[-1] == SuiteOptions(
        backend="gloo",
        world_size=2,
        api=("wrapper", "fully_shard"),
        mesh=("hsdp",),
        only=("*/bf16/*", "*mlp"),
        exclude=("x*",),
        steps=5,
        seed=7,
    )


def test_filters_that_match_nothing_are_a_usage_error(engine, capsys):
    err = usage_error(capsys, ["--only", "nothing*", "--api", "wrapper"])
    assert "no scenario matches --api wrapper --only nothing* on the threaded backend" in err
    engine.results = []
    assert "no scenario for the threaded backend at world size 4" in usage_error(capsys, [])


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--backend", "nccl"], "--backend nccl needs CUDA, which is not available"),
        (["--device", "cuda"], "--device cuda needs CUDA, which is not available"),
        (["--world-size", "0"], "--world-size: must be at least 1, got 0"),
        (["--steps", "two"], "--steps: expected a whole number, got 'two'"),
        (["--mesh", "4d"], "--mesh: invalid choice: '4d'"),
        (["--api", "ddp"], "--api: invalid choice: 'ddp'"),
        (["--backend", "mpi"], "--backend: invalid choice: 'mpi'"),
        (["--list", "--self-test"], "--self-test: not allowed with argument --list"),
        (["--self-test", "--api", "naive"], "--api naive has none"),
    ],
)
def test_bad_arguments_name_the_problem(engine, no_cuda, capsys, argv, problem):
    assert problem in usage_error(capsys, argv)


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--backend", "gloo", "--device", "cuda"], "--backend gloo runs on CPU"),
        (["--backend", "nccl", "--device", "cpu"], "--backend nccl runs on CUDA"),
        (["--backend", "nccl"], "--world-size 4 needs 4 GPUs, this machine has 1"),
    ],
)
def test_backend_and_device_must_agree(engine, one_gpu, capsys, argv, problem):
    assert problem in usage_error(capsys, argv)


def test_nccl_runs_on_cuda_with_one_rank_per_gpu(engine, one_gpu):
    assert cli.main(["--list", "--backend", "nccl", "--world-size", "1"]) == 0
    assert engine.options[-1] == SuiteOptions(backend="nccl", device="cuda", world_size=1)
    assert cli.main(["--list", "--device", "cuda", "--world-size", "8"]) == 0
    assert engine.options[-1] == SuiteOptions(device="cuda", world_size=8)


def test_a_report_path_that_is_a_directory_is_refused(engine, capsys, tmp_path):
    assert "--json" in usage_error(capsys, ["--json", str(tmp_path)])


@pytest.mark.parametrize("flag", ["--json", "--junit-xml"])
def test_an_unwritable_report_path_is_refused_before_anything_runs(engine, capsys, tmp_path, flag):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    err = usage_error(capsys, [flag, str(in_the_way / "parity.out")])
    assert f"{flag} {in_the_way / 'parity.out'}: {in_the_way} is not a directory" in err
    assert engine.options == []  # no scenario was listed or run


def test_without_the_engine_the_command_says_so(monkeypatch, capsys):
    for name in cli.ENGINE_NAMES:
        monkeypatch.delattr(parity_suite, name, raising=False)
    assert cli.main([]) == 1
    assert "engine not available" in capsys.readouterr().err


def test_module_runs_as_a_program():
    done = subprocess.run(
        [sys.executable, "-m", "reffsdp.testing", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--junit-xml" in done.stdout and "--self-test" in done.stdout


def test_list_into_a_pipe_closed_early_ends_quietly():
    """``--list | head -1``: the reader is gone before the names are written."""
    process = subprocess.Popen(
        [sys.executable, "-m", "reffsdp.testing", "--list"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert process.returncode == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["pid", "group"])
def test_ctrl_c_ends_a_threaded_run_keeping_what_finished(tmp_path, how):
    """SIGINT to the process alone, or to its process group (Ctrl-C in a terminal): the run
    stops its rank threads and ends at once, exit status 130, no traceback, and the JSON
    holds the scenarios that finished."""
    path = tmp_path / "parity.json"
    ended = interrupt(["reffsdp.testing", "--mesh", "1d", "--json", str(path)], "[1/", how)
    assert ended.returncode == 130, ended.stderr
    assert ended.seconds < deadline_s()
    assert "Traceback" not in ended.stderr and "terminate called" not in ended.stderr
    assert "interrupted after " in ended.stderr
    document = json.loads(path.read_text())
    assert document["interrupted"] is True
    assert 1 <= document["summary"]["total"] < 21
    assert document["scenarios"][0]["status"] == "passed"


def test_pytest_arguments_after_dashes_select_by_mark_and_keyword(engine, capsys):
    """Each scenario is a pytest test marked with its API and mesh; ``--`` hands the rest of
    the line to pytest."""
    assert cli.main(["--list", "--", "-m", "fully_shard and not 1d"]) == 0
    assert capsys.readouterr().out.split() == ["fully_shard/hsdp/bf16/mlp"]
    assert cli.main(["--list", "--", "-m", "wrapper or hsdp", "-k", "not bf16"]) == 0
    assert capsys.readouterr().out.split() == ["wrapper/3d/fp32/mlp"]
    assert cli.main(["--", "-m", "3d", "-x"]) == 1  # one skipped: nothing checked
    assert engine.options[-1].only == ("wrapper/3d/fp32/mlp",)  # the engine runs no other
    out = capsys.readouterr().out
    assert out.startswith("reffsdp parity suite: 1 scenario, threaded backend")
    assert "[1/1] SKIP wrapper/3d/fp32/mlp" in out and "0 passed, 0 failed, 1 skipped" in out


def test_pytest_arguments_that_leave_nothing_or_that_pytest_refuses(engine, capsys):
    assert cli.main(["--", "-k", "no-such-scenario"]) == 2
    assert "no scenario ran: the filters left none (pytest: -k no-such-scenario)" in (
        capsys.readouterr().err
    )
    assert cli.main(["--", "--no-such-pytest-flag"]) == 2
    assert "--no-such-pytest-flag" in capsys.readouterr().err


def test_the_folder_it_runs_in_does_not_configure_its_pytest(engine, capsys, tmp_path, monkeypatch):
    """A project's pytest.ini, conftest.py and PYTEST_ADDOPTS are that project's own: the
    suite's pytest session reads none of them."""
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --no-such-flag-from-ini\n")
    (tmp_path / "conftest.py").write_text("raise RuntimeError('a conftest was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTEST_ADDOPTS", "--no-such-flag-from-env")
    assert cli.main([]) == 0
    assert "2 passed, 0 failed, 1 skipped" in capsys.readouterr().out
    assert os.environ["PYTEST_ADDOPTS"] == "--no-such-flag-from-env"  # given back
    assert not (tmp_path / ".pytest_cache").exists()


def test_pytest_imports_no_second_copy_of_the_package():
    """From a checkout, the package's folder is ``testing/``: collected by its path, its test
    module would be imported again as ``testing.parity_tests`` (a fresh process, as this
    session's doctests import ``testing/`` under that name themselves)."""
    program = (
        "import sys\n"
        "from reffsdp.testing import __main__ as cli\n"
        "status = cli.main(['--only', 'naive/1d/fp32/mlp', '--steps', '1'])\n"
        "print(status, [m for m in sys.modules if m.split('.')[0] == 'testing'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr


def test_console_script_points_at_main():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["reffsdp-parity"].partition(":")
    assert module == "reffsdp.testing.__main__" and function == "main"
    assert getattr(sys.modules[module], function) is cli.main


# --- running and printing -----------------------------------------------------------------


def test_a_passing_run_prints_lines_table_and_summary(engine, capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "[1/3] PASS fully_shard/1d/fp32/mlp 1.2 s" in out
    assert "[3/3] SKIP wrapper/3d/fp32/mlp 1.2 s  (needs 8 ranks" in out
    table = out[out.index("scenario") :]
    row = next(line for line in table.splitlines() if line.startswith("fully_shard/hsdp"))
    assert row.split() == [
        *("fully_shard/hsdp/bf16/mlp", "PASS", "3", "0.0e+00", "1.5e-07", "2.0e-07"),
        *("1e-05/1e-05", "4/4", "4/4", "0/0", "4.0", "KiB", "(3.0", "KiB)", "1.2"),
    ]
    assert "skipped wrapper/3d/fp32/mlp: needs 8 ranks" in out
    assert out.rstrip().splitlines()[-1].startswith("2 passed, 0 failed, 1 skipped in ")
    assert "\r" not in out  # no progress bar where stdout is not a terminal


def test_every_scenario_skipped_fails_the_run_unless_skips_are_allowed(engine, capsys):
    engine.results = [engine.results[2]]
    assert cli.main([]) == 1
    assert "every scenario was skipped" in capsys.readouterr().err
    assert cli.main(["--allow-skips"]) == 0
    engine.results.append(result("fully_shard/1d/fp32/mlp"))
    assert cli.main([]) == 0  # some ran


def test_one_scenario_is_singular(engine, capsys):
    assert cli.main(["--list", "--only", "*/1d/*"]) == 0
    assert capsys.readouterr().err == "1 scenario\n"
    assert cli.main(["--only", "*/1d/*", "--steps", "1"]) == 0
    assert "reffsdp parity suite: 1 scenario, threaded backend on cpu, world size 4, 1 step," in (
        capsys.readouterr().out
    )


LOAD_ERROR = (
    "RuntimeError: Error(s) in loading state_dict for FullyShardedDataParallel:\n"
    '\tMissing key(s) in state_dict: "layers.0.weight".\n'
    '\tUnexpected key(s) in state_dict: "layers.0._flat_param".'
)
LOAD_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "suite_scenarios.py", line 10, in reload\n'
    "    model.load_state_dict(state)\n" + LOAD_ERROR
)


def test_a_failure_keeps_its_whole_message_and_traceback(engine, capsys, tmp_path):
    engine.results[1] = result(
        "fully_shard/hsdp/bf16/mlp", "failed", "error: " + LOAD_ERROR, traceback=LOAD_TRACEBACK
    )
    paths = ["--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")]
    assert cli.main(paths) == 1
    out = capsys.readouterr().out
    live = next(line for line in out.splitlines() if line.startswith("[2/3]"))
    assert live.endswith(
        "(error: RuntimeError: Error(s) in loading state_dict for FullyShardedDataParallel:)"
    )
    failures = out[out.index("FAILED fully_shard/hsdp/bf16/mlp") :]
    for line in LOAD_TRACEBACK.splitlines():
        assert line.strip() in failures
    scenario = json.loads((tmp_path / "r.json").read_text())["scenarios"][1]
    assert scenario["message"] == "error: " + LOAD_ERROR
    assert scenario["traceback"] == LOAD_TRACEBACK
    failure = ET.parse(tmp_path / "r.xml").getroot().find("testsuite/testcase/failure")
    assert LOAD_ERROR in failure.text and "in reload" in failure.text


def test_the_table_fits_the_terminal_and_stays_whole_elsewhere(engine, capsys, monkeypatch):
    engine.results[0] = result("fully_shard/hsdp/sd-full/transformer")
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("fully_shard/hsdp/sd-full"))
    assert row.split()[-1] == "1.2" and "(3.0 KiB)" in row  # every column, on one line
    assert len(row) > 120

    monkeypatch.setattr(cli, "_is_terminal", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    table = out[out.index("\nscenario") : out.index("passed, ")]
    assert max(len(line) for line in table.splitlines()) <= 80
    lines = table.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("fully_shard/hsdp/sd-full/ "))
    assert lines[row + 1] == "transformer"  # the name breaks after a "/"
    assert "not shown at this width: steps, atol/rtol, bytes/rank/step (min), s" in " ".join(
        table.split()
    )
    for width in (100, 60, 200):
        lines = report.format_table(engine.results, width).splitlines()
        assert max(len(line) for line in lines) <= max(width, 70), width
        assert any(line.startswith("wrapper/3d/fp32/mlp") for line in lines)


def test_a_failing_scenario_fails_the_run_and_shows_its_message(engine, capsys):
    engine.results[1] = result(
        "fully_shard/hsdp/bf16/mlp", "failed", "gradients differ at step 2\nmax |Δgrad| 0.5"
    )
    assert cli.main([]) == 1
    out = capsys.readouterr().out
    assert "[2/3] FAIL fully_shard/hsdp/bf16/mlp 1.2 s  (gradients differ at step 2)" in out
    failures = out[out.index("FAILED fully_shard/hsdp/bf16/mlp") :]
    assert "    gradients differ at step 2\n    max |Δgrad| 0.5" in failures
    assert out.index("scenario") < out.index("FAILED")  # after the table
    assert "1 passed, 1 failed, 1 skipped in" in out


def test_the_table_shows_a_count_mismatch(engine, capsys):
    counts = {"all_gather": 5.0, "reduce_scatter": 4.0, "all_reduce": 0.0}
    engine.results[0] = result(
        "fully_shard/1d/fp32/mlp", "failed", "all_gather: 5 per step, expected 4", counts=counts
    )
    assert cli.main([]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("fully_shard/1d/fp32/mlp"))
    assert " 5/4! " in row and " 4/4 " in row
    assert "differs" in out  # the legend says what "!" means


def test_results_that_arrive_in_another_order_reach_their_tests(engine, capsys):
    """Rank processes report the scenarios they skip first: each test finds its own."""
    engine.skipped_first = True
    engine.results[1] = result("fully_shard/hsdp/bf16/mlp", "failed", "params differ")
    assert cli.main([]) == 1
    out = capsys.readouterr().out
    assert "[1/3] PASS fully_shard/1d/fp32/mlp" in out and "[3/3] SKIP wrapper/3d" in out
    assert "[2/3] FAIL fully_shard/hsdp/bf16/mlp" in out
    assert "1 passed, 1 failed, 1 skipped" in out


def test_an_engine_crash_keeps_the_finished_results(engine, capsys, tmp_path):
    engine.crash_after = 1
    paths = ["--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml")]
    assert cli.main(paths) == 1
    captured = capsys.readouterr()
    assert "rank 2 lost its process group" in captured.err
    assert "1 passed, 0 failed, 0 skipped" in captured.out
    document = json.loads((tmp_path / "r.json").read_text())
    assert "rank 2 lost its process group" in document["error"]
    assert [s["name"] for s in document["scenarios"]] == ["fully_shard/1d/fp32/mlp"]
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("errors") == "1" and suite.find("testcase/error") is not None


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_and_plain_lines_elsewhere(monkeypatch):
    monkeypatch.delenv("TERM", raising=False)
    stream = Terminal()
    with cli.Progress(stream, 2) as progress:
        progress.add("[1/2] PASS a 0.1 s")
    text = stream.getvalue()
    assert "[1/2] PASS a 0.1 s\n" in text
    assert "0/2" in text and "1/2" in text  # the bar, drawn by rich
    assert text.endswith("\x1b[2K")  # and gone once the run ends

    stream = io.StringIO()  # a file or a pipe: the lines, nothing else
    with cli.Progress(stream, 2) as progress:
        progress.add("[1/2] PASS a 0.1 s")
    assert stream.getvalue() == "[1/2] PASS a 0.1 s\n"


# --- report files -------------------------------------------------------------------------


def test_json_report_carries_metadata_summary_and_scenarios(engine, tmp_path, capsys):
    path = tmp_path / "out" / "parity.json"  # missing folders are created
    assert cli.main(["--json", str(path), "--seed", "3", "--mesh", "hsdp", "--mesh", "3d"]) == 0
    document = json.loads(path.read_text())
    assert document["torch_version"] == torch.__version__
    assert document["python_version"].count(".") == 2
    assert document["reffsdp_version"]
    meta = {k: document[k] for k in ("device", "backend", "world_size", "seed", "steps")}
    assert meta == {"device": "cpu", "backend": "threaded", "world_size": 4, "seed": 3, "steps": 3}
    assert document["device_name"]
    assert document["started"].endswith("+00:00") and document["seconds"] >= 0
    assert document["filters"]["mesh"] == ["hsdp", "3d"]
    assert document["summary"] == {"total": 2, "passed": 1, "failed": 0, "skipped": 1}
    assert document["scenarios"] == [engine.results[1].to_dict(), engine.results[2].to_dict()]


def test_json_report_writes_nan_as_a_string(engine, tmp_path, capsys):
    engine.results[0] = result("fully_shard/1d/fp32/mlp", "failed", "loss", max_loss_diff=math.nan)
    assert cli.main(["--json", str(tmp_path / "r.json")]) == 1
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text)["scenarios"][0]["max_loss_diff"] == "nan"
    assert "NaN" not in text


def test_junit_xml_has_one_testcase_per_scenario(engine, tmp_path, capsys):
    engine.results[1] = result(
        "fully_shard/hsdp/bf16/mlp", "failed", "\x1b[31mlosses differ\x1b[0m at step 1\ndetail"
    )
    path = tmp_path / "parity.xml"
    assert cli.main(["--junit-xml", str(path)]) == 1
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    attrs = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
    assert attrs == {"tests": "3", "failures": "1", "errors": "0", "skipped": "1"}
    assert float(suite.get("time")) >= 0 and suite.get("timestamp")
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert properties["torch_version"] == torch.__version__
    assert properties["backend"] == "threaded"
    assert json.loads(properties["filters"]) == {"api": [], "mesh": [], "only": [], "exclude": []}
    cases = suite.findall("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("parity.fully_shard.1d", "fully_shard/1d/fp32/mlp"),
        ("parity.fully_shard.hsdp", "fully_shard/hsdp/bf16/mlp"),
        ("parity.wrapper.3d", "wrapper/3d/fp32/mlp"),
    ]
    assert cases[0].find("failure") is None and cases[0].find("skipped") is None
    assert "AG 4/4  RS 4/4  AR 0/0" in cases[0].find("system-out").text  # its numbers
    failure = cases[1].find("failure")
    assert failure.get("message").startswith("Failed: #x1B[31mlosses differ#x1B[0m at step 1")
    assert failure.text.endswith("at step 1\ndetail")
    assert cases[2].find("skipped").get("message") == "needs 8 ranks, the gloo world has 4"


# --- --self-test --------------------------------------------------------------------------


def test_self_test_prints_each_bug_with_the_check_that_caught_it(engine, capsys, tmp_path):
    paths = ["--json", str(tmp_path / "s.json"), "--junit-xml", str(tmp_path / "s.xml")]
    assert cli.main(["--self-test", "--api", "wrapper", *paths]) == 0
    out = capsys.readouterr().out
    assert "[1] CAUGHT fully_shard: wrong gradient divide factor  by grad 0.5" in out
    assert "[2] CAUGHT wrapper: reshard skipped  by all_gather 2/4" in out
    assert "2 of 2 planted bugs caught in" in out
    assert engine.options[-1].api == ("wrapper",)
    document = json.loads((tmp_path / "s.json").read_text())
    assert document["summary"] == {"total": 2, "caught": 2, "missed": 0}
    assert document["self_test"] == [bug.to_dict() for bug in engine.bugs]
    suite = ET.parse(tmp_path / "s.xml").getroot().find("testsuite")
    assert suite.get("tests") == "2" and suite.get("failures") == "0"


def test_self_test_fails_when_one_bug_is_not_caught(engine, capsys, tmp_path):
    engine.bugs[1] = SelfTestResult("reshard skipped", "wrapper", False, "", 0.5)
    assert cli.main(["--self-test", "--junit-xml", str(tmp_path / "s.xml")]) == 1
    out = capsys.readouterr().out
    assert "[2] MISSED wrapper: reshard skipped" in out
    assert "1 of 2 planted bugs caught" in out
    suite = ET.parse(tmp_path / "s.xml").getroot().find("testsuite")
    (case,) = [c for c in suite.findall("testcase") if c.find("failure") is not None]
    assert (case.get("classname"), case.get("name")) == ("self_test.wrapper", "reshard skipped")


def test_self_test_with_no_bugs_run_fails(engine, capsys):
    engine.bugs = []
    assert cli.main(["--self-test"]) == 1


# --- report functions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "measured, expected, text",
    [(4.0, 4.0, "4/4"), (5.0, 4.0, "5/4!"), (0.5, 0.5, "0.5/0.5"), (None, 2.0, "0/2!")],
)
def test_format_count(measured, expected, text):
    assert report.format_count(measured, expected) == text


@pytest.mark.parametrize(
    "value, text",
    [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 << 30, "3.0 GiB")],
)
def test_format_bytes(value, text):
    assert report.format_bytes(value) == text


def test_summary_line_counts_unknown_statuses_as_failures():
    results = [result("a/1d/f/m"), result("b/1d/f/m", "error", "boom")]
    assert report.summary_line(results, 2.04) == "1 passed, 1 failed, 0 skipped in 2.0 s"


# --- a launched world ---------------------------------------------------------------------

TORCHRUN_RANK_0 = {
    "RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.fixture
def torchrun_rank(monkeypatch, no_cuda):
    """The environment torchrun gives a worker: 2 nodes x 2 ranks, CPU only."""

    def set_rank(rank: int) -> None:
        environment = {**TORCHRUN_RANK_0, "RANK": str(rank), "LOCAL_RANK": str(rank % 2)}
        for key, value in environment.items():
            monkeypatch.setenv(key, value)

    set_rank(0)
    return set_rank


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--backend", "threaded"], "--backend threaded conflicts with the launched world: "),
        (["--backend", "nccl"], "torchrun launched 4 ranks, which runs on gloo here"),
        (["--world-size", "2"], "--world-size 2 conflicts with the launched world: torchrun "),
    ],
)
def test_backend_or_world_size_against_the_launched_world_is_a_usage_error(
    engine, torchrun_rank, capsys, argv, problem
):
    assert problem in usage_error(capsys, argv)


def test_a_launched_world_gives_backend_world_size_and_nodes(engine, torchrun_rank):
    assert cli.main(["--list", "--backend", "gloo", "--world-size", "4"]) == 0  # agreeing
    assert cli.main(["--list", "--timeout", "60"]) == 0
    assert engine.options[-1] == SuiteOptions(
        backend="gloo", device="cpu", world_size=4, nodes=2, timeout_s=60.0
    )


def test_a_half_described_launch_is_a_usage_error(engine, torchrun_rank, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_PORT")
    assert "torchrun started this process but MASTER_PORT is not set" in usage_error(capsys, [])


def test_rank_0_alone_prints_and_writes_the_reports(engine, torchrun_rank, tmp_path, capsys):
    torchrun_rank(1)
    assert cli.main(["--json", str(tmp_path / "rank1.json")]) == 0
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "rank1.json").exists()
    torchrun_rank(0)
    assert cli.main(["--json", str(tmp_path / "rank0.json")]) == 0
    assert "launched by torchrun: 2 nodes x 2 ranks" in capsys.readouterr().out
    document = json.loads((tmp_path / "rank0.json").read_text())
    launch = {key: document[key] for key in ("launcher", "world_size", "nodes", "ranks_per_node")}
    assert launch == {"launcher": "torchrun", "world_size": 4, "nodes": 2, "ranks_per_node": 2}


def test_a_run_this_command_started_records_its_launch_as_spawn(engine, tmp_path, capsys):
    assert cli.main(["--json", str(tmp_path / "parity.json"), "--world-size", "2"]) == 0
    document = json.loads((tmp_path / "parity.json").read_text())
    launch = {key: document[key] for key in ("launcher", "world_size", "nodes", "ranks_per_node")}
    assert launch == {"launcher": "spawn", "world_size": 2, "nodes": 1, "ranks_per_node": 2}
