"""The parity suite checks other FSDP implementations than reffsdp, on threaded ranks.

torch's own (``--impl torch``): both APIs on the 1-D and HSDP meshes train torch's modules
and pass, CPU offload is unsupported with torch's message, the ``fp8-gather`` scenario
expects no size handshake of it; the suite's own run never reaches torch's FSDP. A fork
(``tests/fork_impl.py``, reffsdp's ``fully_shard`` with a wrong gradient divide factor) is
caught, and its missing wrapper is not applicable. The same collectives are seen of reffsdp
through its seam and through ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

import reffsdp
import reffsdp.testing.__main__ as cli
from reffsdp.testing.impls import load_implementation
from reffsdp.testing.multithread import run_threaded
from reffsdp.testing.parity_suite import SuiteOptions, run_suite
from reffsdp.testing.suite_scenarios import all_specs, build_scenario

pytestmark = pytest.mark.multithread

TORCH_SUBSET = (
    "fully_shard/1d/fp32/convnet",
    "fully_shard/1d/fp8-gather/mlp",
    "fully_shard/hsdp/bf16/convnet",
    "fully_shard/1d/offload/transformer",
    "wrapper/1d/reshard/mlp",
    "wrapper/hsdp/orig-params/convnet",
    "wrapper/1d/offload/transformer",
    "naive/1d/fp32/mlp",
)


def _pinning_refusal() -> str:
    """What this torch raises when asked to pin memory without an accelerator, as torch's
    FSDP does for CPU offload: a CPU build and a CUDA build on a machine without a GPU word
    it differently."""
    try:
        torch.empty(1).pin_memory()
    except RuntimeError as error:
        return f"RuntimeError: {error}".strip()
    return "(this machine pins memory)"


NO_ACCELERATOR = _pinning_refusal()


def _by_name(results):
    return {result.name: result for result in results}


def test_torch_passes_both_apis_on_1d_and_hsdp_and_its_refusals_are_unsupported():
    results = _by_name(run_suite(SuiteOptions(impl="torch", only=TORCH_SUBSET)))
    assert set(results) == set(TORCH_SUBSET)
    for name in TORCH_SUBSET:
        if "offload" in name or name.startswith("naive"):
            continue
        assert results[name].status == "passed", (name, results[name].message)
    # torch's fully_shard refuses CPU offload without an accelerator when it shards...
    offload = results["fully_shard/1d/offload/transformer"]
    assert offload.status == "unsupported"
    assert offload.message == f"torch's fully_shard raised {NO_ACCELERATOR}"
    # ... and its wrapper when it sets itself up, at the first forward.
    offload = results["wrapper/1d/offload/transformer"]
    assert offload.status == "unsupported"
    assert offload.message == (
        f"torch raised {NO_ACCELERATOR}\n(before its first training step, as its parameters "
        "were first read: the implementation was setting itself up)"
    )
    naive = results["naive/1d/fp32/mlp"]
    assert naive.status == "not_applicable" and "NaiveFSDP" in naive.message
    # torch checks hook inputs on the padded rank alone: no size handshake is expected
    fp8 = results["fully_shard/1d/fp8-gather/mlp"]
    assert fp8.counts["all_gather"] == fp8.expected_counts["all_gather"] == 6


def _built_model(name: str, impl: str) -> list[type]:
    """The classes of the sharded model ``impl`` builds for scenario ``name``."""
    (spec,) = [spec for spec in all_specs() if spec.name == name]
    found: dict[int, list[type]] = {}

    def on_rank(rank: int) -> None:
        built = build_scenario(spec, torch.device("cpu"), load_implementation(impl))
        found[rank] = [type(module) for module in built.model.modules()]

    run_threaded(on_rank, 2)
    return found[0]


def test_torch_trains_torchs_own_modules():
    classes = _built_model("fully_shard/1d/fp32/convnet", "torch")
    assert issubclass(classes[0], torch_fsdp.FSDPModule)
    assert not any(issubclass(c, reffsdp.FSDPModule) for c in classes)
    classes = _built_model("wrapper/1d/fp32/convnet", "torch")
    assert classes[0] is torch_fsdp.FullyShardedDataParallel
    assert classes.count(torch_fsdp.FullyShardedDataParallel) == 3  # two convolutions, root
    assert reffsdp.FullyShardedDataParallel not in classes


class _TorchsFSDPCalled(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise _TorchsFSDPCalled("torch's FSDP was called")


def test_the_default_run_never_calls_torchs_fsdp(capsys):
    """Every way into torch's ``fully_shard`` builds its state, and every way into its
    wrapper runs its constructor: both raise while the suite runs reffsdp, on every API
    and mesh kind of the subset. The same spies do stop ``--impl torch``."""
    subset = ["--only", "*/1d/fp32/*", "--only", "*/hsdp/reshard/*", "--only", "*/2d/tied/*"]
    with (
        mock.patch.object(FSDPState, "__init__", _refuse),
        mock.patch.object(torch_fsdp.FullyShardedDataParallel, "__init__", _refuse),
    ):
        assert cli.main(subset) == 0
        assert "6 passed, 0 failed, 0 skipped in " in capsys.readouterr().out
        results = run_suite(SuiteOptions(impl="torch", only=("fully_shard/1d/fp32/convnet",)))
    (spied,) = results
    assert spied.status == "unsupported", spied.message
    assert "_TorchsFSDPCalled: torch's FSDP was called" in spied.message


def test_a_fork_with_a_wrong_divide_factor_is_caught_and_its_missing_wrapper_not_applicable():
    only = ("fully_shard/1d/reshard/mlp", "fully_shard/hsdp/fp32/mlp", "wrapper/1d/fp32/convnet")
    results = _by_name(run_suite(SuiteOptions(impl="tests.fork_impl", only=only)))
    for name in only[:2]:
        assert results[name].status == "failed", name
        assert results[name].message.startswith("gradients: "), results[name].message
    wrapper = results["wrapper/1d/fp32/convnet"]
    assert wrapper.status == "not_applicable"
    assert wrapper.message.startswith("tests.fork_impl does not export FullyShardedDataParallel")


def test_reffsdps_collectives_are_the_same_seen_through_torch_distributed():
    """The observer other implementations get sees what reffsdp's seam sees, on every mesh
    (tensor parallelism's DTensor collectives left out) and on the wrapper."""
    only = (
        "fully_shard/1d/fp8-gather/mlp",
        "fully_shard/hsdp/accum/mlp",
        "fully_shard/3d/bf16/mlp",
        "wrapper/hsdp/orig-params/convnet",
    )
    seam = run_suite(SuiteOptions(only=only))
    reffsdp_from_outside = dataclasses.replace(load_implementation(), through_reffsdp_seam=False)
    with mock.patch("reffsdp.testing.suite_backends.load_implementation") as loader:
        loader.return_value = reffsdp_from_outside
        with mock.patch("reffsdp.testing.suite_rank.resolve", return_value=reffsdp_from_outside):
            outside = run_suite(SuiteOptions(only=only))
    for a, b in zip(seam, outside):
        assert a.status == b.status == "passed", (a.name, a.message, b.message)
        assert (a.counts, a.bytes_per_step) == (b.counts, b.bytes_per_step), a.name


def test_unsupported_fails_the_run_unless_allowed(capsys):
    argv = ["--impl", "torch", "--only", "fully_shard/1d/offload/*", "--only", "*/1d/bf16/mlp"]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "2 passed, 0 failed, 1 unsupported, 0 skipped in " in out  # bf16 of both APIs
    assert "UNSUPPORTED fully_shard/1d/offload/transformer" in out
    assert "torch refused to set up 1 scenario (unsupported" in err
    assert "pass --allow-unsupported" in err
    assert cli.main([*argv, "--allow-unsupported"]) == 0


def test_the_readme_runs_your_model_under_torchs_fsdp():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    own = readme.split("## Checking your own model")[1].split("\n## ")[0]
    theirs = readme.split("## Checking torch's FSDP, or yours")[1].split("\n## ")[0]
    namespace: dict = {}
    for text in (own, theirs):
        block = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)[0]
        exec(compile(block, "README.md", "exec"), namespace)
    scenarios = {scenario.name: scenario for scenario in namespace["SCENARIOS"]}
    assert len(scenarios) == 24 and {s.impl for s in scenarios.values()} == {"torch"}
    for name in ("fully_shard/1d/reshard/custom", "wrapper/hsdp/accum/custom"):
        result = scenarios[name].run_threaded()
        assert result.status == "passed", (name, result.message)
    offload = scenarios["fully_shard/hsdp/offload/custom"].run_threaded()
    assert offload.status == "unsupported" and NO_ACCELERATOR in offload.message


@pytest.mark.parametrize(
    "name", ["wrapper/1d/tied/transformer", "wrapper/hsdp/orig-params/convnet"]
)
def test_any_wrapper_is_read_as_reffsdps_own_reader_reads_it(name):
    """The reader for other implementations' wrappers (their public summon_full_params)
    rebuilds reffsdp's wrapper exactly as reffsdp's own reader does."""
    from reffsdp.testing.parity import summoned_params, unflattened_params

    (spec,) = [spec for spec in all_specs() if spec.name == name]

    def on_rank(rank: int) -> None:
        built = build_scenario(spec, torch.device("cpu"), load_implementation())
        inputs = built.make_inputs(0, rank)
        out = built.model(*inputs) if isinstance(inputs, tuple) else built.model(inputs)
        out.sum().backward()
        own = unflattened_params(built.model)
        read = summoned_params(built.model)
        assert own is not None and read is not None and sorted(own) == sorted(read)
        for key, (param, grad) in own.items():
            assert torch.equal(param, read[key][0]), key
            assert grad is not None and torch.equal(grad, read[key][1]), key

    run_threaded(on_rank, 4)


def test_the_self_test_catches_every_bug_planted_under_torchs_fsdp():
    """``--self-test --impl torch``: the faults planted in the process group, and the fp8
    weight that ignores ``out=``, fail torch's fully_shard and wrapper as they fail
    reffsdp's, each by a numeric check (the faults leave counts and bytes as they were)."""
    from reffsdp.testing.parity_suite import run_self_test

    results = run_self_test(SuiteOptions(impl="torch"))
    assert len(results) == 11 and {r.api for r in results} == {"fully_shard", "wrapper"}
    missed = [(r.bug, r.api) for r in results if not r.caught]
    assert not missed, missed
    assert all(
        r.caught_by.split(":")[0] in ("losses", "gradients", "parameters") for r in results
    ), [(r.bug, r.api, r.caught_by) for r in results]
