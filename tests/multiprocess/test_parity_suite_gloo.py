"""The parity suite on 4 gloo processes: the engine spawns the ranks, runs a subset of the
matrix on them (1-D, HSDP and 2-D meshes, both APIs) and ships each result back to this
process as it finishes; the 8-rank 3-D scenario does not fit and is skipped."""

import pytest

from reffsdp.testing.parity_suite import SuiteOptions, run_suite

pytestmark = pytest.mark.multiprocess

SUBSET = (
    "fully_shard/1d/reshard/mlp",
    "fully_shard/2d/fp32/mlp",
    "fully_shard/3d/fp32/mlp",
    "wrapper/hsdp/bf16/convnet",
    "wrapper/hsdp/tied/transformer",
)


def test_subset_over_gloo_processes():
    seen = []
    results = run_suite(SuiteOptions(backend="gloo", world_size=4, only=SUBSET), seen.append)
    assert seen == results
    by_name = {result.name: result for result in results}
    assert sorted(by_name) == sorted(SUBSET)
    skipped = by_name.pop("fully_shard/3d/fp32/mlp")
    assert skipped.status == "skipped" and "8" in skipped.message
    for result in by_name.values():
        assert result.status == "passed", (result.name, result.message)
        assert result.counts == result.expected_counts, result.name
        assert result.bytes_per_step == result.min_bytes_per_step, result.name
        assert result.world_size == 4 and result.seconds > 0
    # The same seed gives the same numbers, bit for bit.
    (again,) = run_suite(
        SuiteOptions(backend="gloo", world_size=4, only=("wrapper/hsdp/tied/transformer",))
    )
    first = by_name["wrapper/hsdp/tied/transformer"]
    assert (again.losses, again.max_loss_diff, again.max_grad_diff) == (
        first.losses,
        first.max_loss_diff,
        first.max_grad_diff,
    )


def test_self_test_over_gloo_processes(monkeypatch):
    """The self-test's scenarios are not in the suite's matrix: rank processes run the specs
    they are handed (they looked names up in the matrix: a KeyError for each)."""
    from reffsdp.testing import self_test

    monkeypatch.setattr(self_test, "BUGS", self_test.BUGS[:1])  # the wrong divide factor
    options = SuiteOptions(backend="gloo", world_size=2, api=("wrapper",))
    (outcome,) = self_test.run_self_test(options)
    assert outcome.caught, outcome.caught_by
    assert "KeyError" not in outcome.caught_by
