"""The implementation under test is a parameter (``--impl``, ``impl=``): loading it by name,
which APIs it has, and what the command line and its reports say about it. Nothing here
trains: scenarios that run are in ``tests/multithread/test_parity_impls.py`` and
``tests/multiprocess/test_parity_impls_gloo.py``."""

from __future__ import annotations

import json
import types
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp

import reffsdp
import reffsdp.testing.__main__ as cli
from reffsdp.testing import parity_scenarios, report
from reffsdp.testing.impls import ImplementationError, from_module, load_implementation
from reffsdp.testing.parity_suite import SuiteOptions, list_scenarios

FORK = "tests.fork_impl"
WRAPPER_SCENARIOS = 22  # 11 features on 1d and hsdp
NAIVE_SCENARIOS = 2


def test_reffsdp_is_the_default_and_is_observed_through_its_seam_with_its_handshake():
    impl = load_implementation()
    assert impl.name == "reffsdp" and impl.module is reffsdp
    assert impl.missing == () and impl.not_applicable("naive") == ""
    assert impl.through_reffsdp_seam and impl.size_handshakes
    assert impl.wrapper_kwargs(torch.device("cpu")) == {}


def test_torch_is_torch_distributed_fsdp_with_torchs_version_and_device_on_cpu():
    impl = load_implementation("torch")
    assert impl.module is torch_fsdp and impl.version == torch.__version__
    assert impl.label == f"torch {torch.__version__}"
    assert impl.missing == () and not impl.size_handshakes and not impl.through_reffsdp_seam
    assert impl.wrapper_kwargs(torch.device("cpu")) == {"device_id": torch.device("cpu")}
    assert "NaiveFSDP" in impl.not_applicable("naive")


def test_a_module_without_the_wrapper_has_its_wrapper_scenarios_not_applicable():
    impl = load_implementation(FORK)
    assert impl.version == "0.1.0+fork"
    assert impl.not_applicable("fully_shard") == ""
    reason = impl.not_applicable("wrapper")
    assert reason.startswith(f"{FORK} does not export FullyShardedDataParallel, ")
    assert "StateDictType" in reason
    assert impl.size_handshakes  # its fully_shard wraps reffsdp's


def test_names_that_lead_to_no_implementation_are_refused_with_what_to_give():
    with pytest.raises(ImplementationError, match="cannot import the implementation 'no_such"):
        load_implementation("no_such_module.fsdp")
    with pytest.raises(ImplementationError, match="exports neither FSDP API"):
        from_module("empty", types.ModuleType("empty"), "1")
    with pytest.raises(ValueError, match="cannot import"):  # ImplementationError is one
        parity_scenarios(impl="no_such_module")


def test_parity_scenarios_carry_the_implementation():
    scenarios = parity_scenarios(apis=["fully_shard"], meshes=["1d"], impl="torch")
    assert scenarios and {scenario.impl for scenario in scenarios} == {"torch"}
    assert {scenario.impl for scenario in parity_scenarios(meshes=["1d"])} == {"reffsdp"}


def test_the_same_scenarios_are_listed_for_every_implementation():
    names = [info.name for info in list_scenarios(SuiteOptions())]
    assert [info.name for info in list_scenarios(SuiteOptions(impl="torch"))] == names


# -- the command line --------------------------------------------------------------------


def test_an_impl_that_cannot_be_loaded_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--impl", "no_such_module", "--list"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--impl no_such_module: cannot import the implementation 'no_such_module'" in err
    assert "give reffsdp, torch or the dotted path of an importable module" in err


@pytest.mark.parametrize("impl", ["torch", FORK])
def test_the_self_test_of_another_implementation_plants_the_faults_any_fsdp_meets(impl):
    """Another implementation gets the bugs planted below it (the process group's faults,
    the test's own fp8 weight), not the ones that patch reffsdp's internals."""
    from reffsdp.testing.self_test import ANY, BUGS, list_self_test

    options = SuiteOptions(impl=impl)
    planted = list_self_test(options)
    names = {bug.name for bug in BUGS if bug.impl == ANY}
    assert {name for name, _ in planted} == names
    assert len(planted) < len(list_self_test(SuiteOptions()))


def test_list_names_the_implementation_and_what_is_not_applicable(capsys):
    assert cli.main(["--list", "--impl", FORK]) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 66
    missing = WRAPPER_SCENARIOS + NAIVE_SCENARIOS
    assert f"66 scenarios of {FORK} 0.1.0+fork, {missing} not applicable: " in err
    assert "does not export FullyShardedDataParallel" in err and "NaiveFSDP" in err
    assert cli.main(["--list"]) == 0
    assert capsys.readouterr().err.strip() == "66 scenarios"


def test_help_explains_impl_and_unsupported(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--impl NAME" in out and "torch (torch.distributed.fsdp as installed)" in out
    assert "--allow-unsupported" in out and "Unsupported: the implementation refused" in out


def test_reports_carry_the_implementation_and_its_version(tmp_path, capsys):
    """A run in which nothing is applicable trains nothing, and still reports what it
    checked: JSON and JUnit name the implementation and its version, each scenario is not
    applicable with its reason, and the run fails unless --allow-skips."""
    json_path, xml_path = tmp_path / "parity.json", tmp_path / "parity.xml"
    argv = ["--impl", FORK, "--api", "wrapper", "--mesh", "1d", "--only", "*/fp32/*"]
    argv += ["--json", str(json_path), "--junit-xml", str(xml_path)]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "every scenario was skipped, unsupported or n/a, so nothing was checked" in err
    assert f"checking {FORK} 0.1.0+fork" in out
    assert f"implementation: {FORK} 0.1.0+fork" in out
    assert "[1/1] N/A wrapper/1d/fp32/convnet" in out
    assert "0 passed, 0 failed, 0 skipped, 1 not applicable in " in out
    document = json.loads(json_path.read_text())
    assert (document["impl"], document["impl_version"]) == (FORK, "0.1.0+fork")
    assert document["summary"] == {
        "total": 1,
        "passed": 0,
        "failed": 0,
        "skipped": 0,
        "not_applicable": 1,
    }
    (scenario,) = document["scenarios"]
    assert scenario["status"] == "not_applicable"
    assert "does not export FullyShardedDataParallel" in scenario["message"]
    suite = ET.parse(xml_path).getroot().find("testsuite")
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert (properties["impl"], properties["impl_version"]) == (FORK, "0.1.0+fork")
    (case,) = suite.iter("testcase")
    skipped = case.find("skipped")
    assert skipped is not None and "not applicable: " in skipped.get("message")
    assert cli.main([*argv, "--allow-skips"]) == 0


# -- the report ----------------------------------------------------------------------------


def _result(status: str, message: str = "") -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name=f"fully_shard/1d/{status}/mlp",
        status=status,
        message=message,
        steps=3,
        max_loss_diff=None,
        max_grad_diff=None,
        max_param_diff=None,
        atol=None,
        rtol=None,
        counts={},
        expected_counts={},
        bytes_per_step=None,
        min_bytes_per_step=None,
        seconds=0.1,
        traceback="",
    )


def test_unsupported_and_not_applicable_are_counted_apart_and_are_not_failures():
    results = [
        _result("passed"),
        _result("unsupported", "torch's fully_shard raised RuntimeError: no accelerator\nmore"),
        _result("not_applicable", "tests.fork_impl does not export FullyShardedDataParallel"),
    ]
    assert report.summarize(results) == {
        "total": 3,
        "passed": 1,
        "failed": 0,
        "skipped": 0,
        "unsupported": 1,
        "not_applicable": 1,
    }
    assert report.summary_line(results, 1.0) == (
        "1 passed, 0 failed, 1 unsupported, 0 skipped, 1 not applicable in 1.0 s"
    )
    assert not any(report.is_failure(result.status) for result in results)
    assert report.format_failures(results) == ""
    skips = report.format_skips(results)
    assert "not applicable fully_shard/1d/not_applicable/mlp: tests.fork_impl does not" in skips
    assert "unsupported fully_shard/1d/unsupported/mlp: torch's fully_shard raised " in skips
    assert "no accelerator\nmore" in skips  # the implementation's whole message
    table = report.format_table(results)
    assert "UNSUPPORTED" in table and "N/A" in table
    assert report.summary_line(results[:1], 1.0) == "1 passed, 0 failed, 0 skipped in 1.0 s"
