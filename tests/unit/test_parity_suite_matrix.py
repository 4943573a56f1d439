"""The parity suite's matrix, its filters, and the expected-collective arithmetic (no ranks)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch.nn as nn

from reffsdp.testing.expected_comms import (
    CommUnit,
    StepShape,
    expected_per_step,
    flat_numel,
    fully_shard_units,
    naive_units,
    padded_numel,
)
from reffsdp.testing.low_precision import to_float8_gather
from reffsdp.testing.models import MLPStack, TiedMLPStack
from reffsdp.testing.parity_suite import (
    SuiteOptions,
    list_scenarios,
    parity_scenarios,
    run_self_test,
)
from reffsdp.testing.suite_scenarios import (
    APIS,
    FEATURES,
    MESHES,
    MODELS,
    WRAPPER_MESHES,
    ScenarioSpec,
    all_specs,
)

NAIVE = ["naive/1d/fp32/mlp", "naive/1d/accum/transformer"]


def names(**kwargs) -> list[str]:
    return [info.name for info in list_scenarios(SuiteOptions(**kwargs))]


def test_every_feature_on_every_mesh_of_each_api_and_every_model_on_each_api():
    infos = list_scenarios(SuiteOptions())
    assert len({info.name for info in infos}) == len(infos)
    cells = {(i.api, i.mesh, i.feature) for i in infos}
    for api in APIS:
        meshes = MESHES if api == "fully_shard" else WRAPPER_MESHES
        for mesh in meshes:
            for feature in FEATURES:
                if feature == "orig-params" and api == "fully_shard":
                    continue
                if feature == "fp8-gather" and (api == "wrapper" or mesh in ("2d", "3d")):
                    assert (api, mesh, feature) not in cells, (api, mesh, feature)
                    continue
                assert (api, mesh, feature) in cells, (api, mesh, feature)
        assert {i.model for i in infos if i.api == api} == set(MODELS)
    assert not [i for i in infos if i.api == "wrapper" and i.mesh in ("2d", "3d")]
    assert all(i.name == f"{i.api}/{i.mesh}/{i.feature}/{i.model}" for i in infos)


def test_the_naive_scenarios_run_last_and_only_in_the_suite():
    everything = names()
    assert len(everything) == 66 and everything[-2:] == NAIVE
    assert names(api=("naive",)) == NAIVE
    assert not [s for s in parity_scenarios() if s.spec.api == "naive"]
    for apis in (("naive",), ("fully_shard", "naive")):
        with pytest.raises(ValueError, match="unknown API"):
            parity_scenarios(apis=apis)
    with pytest.raises(ValueError, match="plants bugs in"):
        run_self_test(SuiteOptions(api=("naive",)))
    spec = ScenarioSpec("naive", "1d", "fp32", "mlp")
    assert spec.fits(2) == "" and "2 ranks or more" in spec.fits(1)


def test_naive_units_pad_each_parameter_flat_and_take_a_tied_one_once():
    units = naive_units(TiedMLPStack(5), 4)
    # proj (= head) 5x5; MLPs of hidden width 15, 20, 15: weights 15x5 and 5x15, biases
    wide, narrow = [76, 16, 76, 8], [100, 20, 100, 8]
    assert [u.gather_numel for u in units] == [28, *wide, *narrow, *wide]
    assert all(u.reshard_after_forward is False for u in units)
    counts, nbytes = expected_per_step(units, StepShape(4, num_microbatches=2))
    assert counts == {"all_gather": 26.0, "reduce_scatter": 26.0, "all_reduce": 0.0}
    # 608 fp32 elements, gathered and reduced in each of 2 microbatches, 3/4 of them sent
    assert nbytes == 2 * 2 * Fraction(608 * 4 * 3, 4)


def test_world_sizes_per_backend():
    threaded = {i.mesh: i.world_size for i in list_scenarios(SuiteOptions(world_size=4))}
    assert threaded == {"1d": 4, "hsdp": 4, "2d": 4, "3d": 8}
    gloo = {i.mesh: i.world_size for i in list_scenarios(SuiteOptions(backend="gloo"))}
    assert gloo == {"1d": 4, "hsdp": 4, "2d": 4, "3d": 4}  # run_suite skips 3d there


def test_filters():
    everything = names()
    assert names(api=("wrapper",)) == [n for n in everything if n.startswith("wrapper/")]
    assert names(mesh=("3d",)) == [n for n in everything if "/3d/" in n]
    assert names(only=("*/hsdp/bf16/*",)) == [
        "fully_shard/hsdp/bf16/convnet",
        "wrapper/hsdp/bf16/convnet",
    ]
    assert names(only=("wrapper/1d/fp32/*", "*/3d/tied/*")) == [
        "fully_shard/3d/tied/mlp",
        "wrapper/1d/fp32/convnet",
    ]
    assert names(only=("sd-",)) == [n for n in everything if "/sd-" in n]  # no glob: substring
    assert names(mesh=("1d",), exclude=("*transformer",)) == [
        n for n in everything if "/1d/" in n and not n.endswith("transformer")
    ]
    assert names(only=("no-such-scenario",)) == []
    with pytest.raises(ValueError, match="unknown choice"):
        names(mesh=("4d",))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="backend"):
        SuiteOptions(backend="mpi")
    with pytest.raises(ValueError, match="steps"):
        SuiteOptions(steps=0)


def test_parity_scenarios_for_a_custom_model():
    scenarios = parity_scenarios(lambda: nn.Linear(4, 4), lambda i, r: None)
    assert len(scenarios) == 2 * 2 * 6
    assert scenarios[0].name == "fully_shard/1d/fp32/custom"
    with pytest.raises(ValueError, match="tensor-parallel plan"):
        parity_scenarios(lambda: nn.Linear(4, 4), lambda i, r: None, meshes=("2d",))
    with pytest.raises(ValueError, match="both"):
        parity_scenarios(lambda: nn.Linear(4, 4))
    builtin = parity_scenarios(apis=("wrapper",), meshes=("hsdp",), features=("fp32", "tied"))
    assert [s.name for s in builtin] == ["wrapper/hsdp/fp32/mlp", "wrapper/hsdp/tied/transformer"]


def test_padding_arithmetic():
    assert padded_numel((15, 5), 4) == 16 * 5
    assert padded_numel((16,), 4) == 16
    # Linear(5, 3) on 2 ranks: 15 + 3 elements; aligned to 4 fp32 elements, the bias
    # starts at 16 and the total 19 pads to 20.
    assert flat_numel([(3, 5), (3,)], 2, None) == 18
    assert flat_numel([(3, 5), (3,)], 2, 4) == 20
    assert flat_numel([(3, 5), (3,)], 4, None) == 20


def test_full_shard_minimum_is_three_gathers_worth_less_the_unsharded_root():
    shape = StepShape(shard_size=4)
    block = CommUnit("b", 100, 100, 4, 4, True)
    root = CommUnit("r", 20, 20, 4, 4, False)
    counts, nbytes = expected_per_step([block, root], shape)
    assert counts == {"all_gather": 3.0, "reduce_scatter": 2.0, "all_reduce": 0.0}
    assert nbytes == Fraction(3 * 400 * 3, 4) + Fraction(2 * 80 * 3, 4)
    hsdp, _ = expected_per_step([block], StepShape(shard_size=2, replicate_size=2))
    assert hsdp == {"all_gather": 2.0, "reduce_scatter": 1.0, "all_reduce": 1.0}
    frozen = CommUnit("f", 100, 0, 4, 4, True)
    accum, _ = expected_per_step(
        [frozen, block], StepShape(4, num_microbatches=2, sync_every_microbatch=False)
    )
    assert accum == {"all_gather": 8.0, "reduce_scatter": 1.0, "all_reduce": 0.0}


def test_fully_shard_units_follow_ownership_and_the_root_rule():
    model = MLPStack(5)
    model[1].requires_grad_(False)
    units = fully_shard_units([*model, model], 4)
    assert [u.reshard_after_forward for u in units] == [True, True, True]  # root: no params
    assert units[1].reduce_numel == 0
    assert units[0].gather_numel == 16 * 5 + 16 + 8 * 15 + 8


def test_fp8_gather_runs_under_fully_shard_on_1d_and_hsdp_only():
    specs = [s for s in all_specs() if s.feature == "fp8-gather"]
    assert [s.name for s in specs] == [
        "fully_shard/1d/fp8-gather/mlp",  # one-argument hook: uneven rows, padding
        "fully_shard/hsdp/fp8-gather/transformer",  # five-argument hook: even rows
    ]
    assert names(only=("*fp8*",)) == [s.name for s in specs]
    assert [s.name for s in parity_scenarios(features=("fp8-gather",))] == [s.name for s in specs]
    with pytest.raises(ValueError, match="no scenario"):
        parity_scenarios(apis=("wrapper",), features=("fp8-gather",))


@pytest.mark.parametrize("hook_arguments", [1, 5])
def test_fully_shard_units_count_what_the_all_gather_hooks_send(hook_arguments):
    model = MLPStack(5)
    fp32 = fully_shard_units([*model, model], 4)
    to_float8_gather(model, hook_arguments)
    fp8 = fully_shard_units([*model, model], 4)
    # MLP(5, x3) on 4 ranks: in_proj 15 x 5 pads to 16 rows of 5 fp8 bytes and a 4-byte
    # scale each, out_proj 5 x 15 to 8 rows of 15 + 4; the fp32 biases 16 and 8 elements
    assert fp8[0].gathered_bytes == 16 * (5 + 4) + 16 * 4 + 8 * (15 + 4) + 8 * 4 == 392
    assert fp32[0].gathered_bytes == 4 * (16 * 5 + 16 + 8 * 15 + 8) == 896
    assert [u.gathered_bytes for u in fp8] == [
        392,
        20 * (5 + 4) + 20 * 4 + 8 * (20 + 4) + 8 * 4,
        392,
    ]
    for before, after in zip(fp32, fp8):  # elements and the fp32 reduction as before
        assert dataclasses.replace(after, gather_nbytes=None, handshakes=0) == before
    counts, nbytes = expected_per_step(fp8, StepShape(4))
    fp32_counts, fp32_nbytes = expected_per_step(fp32, StepShape(4))
    assert counts == fp32_counts
    # each unit gathered twice (resharded after forward) and reduced once, 3/4 of it sent
    gathered, reduced = sum(u.gathered_bytes for u in fp8), 4 * sum(u.reduce_numel for u in fp8)
    assert nbytes == Fraction(3, 4) * (2 * gathered + reduced) < fp32_nbytes


def test_a_run_spreads_the_one_time_size_handshakes_of_padded_hook_parameters():
    model = MLPStack(5)
    to_float8_gather(model)
    units = fully_shard_units([*model, model], 4)
    # the 15- and 5-row weights pad on 4 ranks, the 20-row one does not; biases are plain
    assert [u.handshakes for u in units] == [2, 1, 2]
    plain = MLPStack(5)
    assert [u.handshakes for u in fully_shard_units([*plain, plain], 4)] == [0, 0, 0]
    steady, steady_bytes = expected_per_step(units, StepShape(4))
    run, run_bytes = expected_per_step(units, StepShape(4), steps=3)
    assert run["all_gather"] == steady["all_gather"] + 5 / 3
    assert run_bytes == steady_bytes + Fraction(5, 3) * 2 * 8 * 3  # 2 int64 to 3 peers each
    reloaded, _ = expected_per_step(units, StepShape(4), steps=3, builds=2)
    assert reloaded["all_gather"] == steady["all_gather"] + 10 / 3
    one_rank, _ = expected_per_step(units, StepShape(1), steps=3)
    assert one_rank["all_gather"] == 0.0  # nothing to gather, nothing to agree on
