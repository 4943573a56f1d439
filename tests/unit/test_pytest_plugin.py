"""``reffsdp.testing.pytest_plugin``: the ``thread_world`` and ``comm_counter`` fixtures, run in
pytest sessions of their own (pytester) exactly as a downstream project loads them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import reffsdp.testing.pytest_plugin as plugin

pytest_plugins = ["pytester"]

PLUGIN_ARGS = ("-p", "reffsdp.testing.pytest_plugin", "-p", "no:cacheprovider", "--strict-markers")


def run(pytester, source: str, *args: str):
    pytester.makepyfile(textwrap.dedent(source))
    return pytester.runpytest(*PLUGIN_ARGS, *args)


# The examples must run without a deprecation warning on every supported torch (2.13 deprecates
# all_gather_into_tensor, and 2.11 and 2.12 have no all_gather_single).
NO_WARNINGS = ("-W", "error::FutureWarning")


def test_the_module_docstring_example_passes(pytester):
    doc = plugin.__doc__
    start = doc.index("    import pytest")
    end = doc.index("\nRanks share one process")
    result = run(pytester, doc[start:end], *NO_WARNINGS)
    result.assert_outcomes(passed=1)


def test_results_come_back_in_rank_order_at_the_marked_world_size(pytester):
    result = run(
        pytester,
        """
        import pytest
        import torch.distributed as dist

        def test_default(thread_world):
            assert thread_world(lambda rank: (rank, dist.get_world_size())) == [(0, 2), (1, 2)]
            assert not dist.is_initialized()  # the main thread never joins the world

        @pytest.mark.world_size(3)
        def test_marked(thread_world):
            assert thread_world.world_size == 3
            assert thread_world(lambda rank: dist.get_rank()) == [0, 1, 2]
            assert thread_world(lambda rank: rank, world_size=5) == [0, 1, 2, 3, 4]
        """,
    )
    result.assert_outcomes(passed=2)


def test_a_rank_error_is_raised_in_the_test(pytester):
    result = run(
        pytester,
        """
        import pytest
        import torch
        import torch.distributed as dist

        def test_caught(thread_world):
            def on_rank(rank):
                if rank == 1:
                    raise ValueError("bad shard on rank 1")
                dist.all_reduce(torch.ones(1))  # rank 0 waits, then is aborted

            with pytest.raises(ValueError, match="bad shard on rank 1"):
                thread_world(on_rank)

        def test_fails(thread_world):
            def on_rank(rank):
                value = torch.tensor([float(rank)])
                dist.all_reduce(value)
                assert value.item() == 2.0, f"rank {rank} reduced to {value.item()}"

            thread_world(on_rank)
        """,
        "-rf",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: rank 0 reduced to 1.0*"])


def test_a_bad_world_size_marker_names_the_problem(pytester):
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.world_size("four")
        def test_it(thread_world):
            pass
        """,
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*world_size(N) with one whole number N >= 1*'four'*"])


def test_comm_counter_counts_per_rank_and_outside_a_world(pytester):
    result = run(
        pytester,
        """
        import pytest
        import torch
        import torch.distributed as dist
        from reffsdp.core.comms import Collective

        @pytest.mark.world_size(2)
        def test_per_rank(thread_world, comm_counter):
            def on_rank(rank):
                with comm_counter.count():
                    dist.all_reduce(torch.ones(3))
                    if rank == 1:
                        dist.all_reduce(torch.ones(3), group=dist.new_group([1]))
                    else:
                        dist.new_group([1])

            thread_world(on_rank)
            assert comm_counter.ranks == [0, 1]
            assert comm_counter.counts(Collective.ALL_REDUCE) == {0: 1, 1: 2}
            assert comm_counter.bytes(Collective.ALL_REDUCE) == {0: 12, 1: 24}
            assert comm_counter[1].get_total_counts() == 2

        def test_outside(comm_counter):
            with comm_counter.count():
                pass
            assert comm_counter.counts() == {0: {}}
            with pytest.raises(KeyError, match="rank 3 never opened"):
                comm_counter[3]
        """,
    )
    result.assert_outcomes(passed=2)


def test_the_documented_example_passes(pytester):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    section = doc[doc.index("## pytest plugin") :]
    start = section.index("```python\n") + len("```python\n")
    result = run(pytester, section[start : section.index("```", start)], *NO_WARNINGS)
    result.assert_outcomes(passed=1)


def test_collective_is_importable_from_the_testing_package():
    import reffsdp.testing
    from reffsdp.core import comms

    assert reffsdp.testing.Collective is comms.Collective
    assert "Collective" in reffsdp.testing.__all__


def test_a_failure_shows_the_tests_frames_and_rank_0s_message_once(pytester):
    result = run(
        pytester,
        """
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.world_size(4)
        def test_fails(thread_world):
            def on_rank(rank):
                value = torch.tensor([float(rank)])
                dist.all_reduce(value)
                assert value.item() == 2.0, f"rank {rank} reduced to {value.item()}"

            thread_world(on_rank)
        """,
    )
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    failure = out[out.index("___ test_fails ___") : out.index("short test summary")]
    assert "multithread.py" not in failure and "pytest_plugin.py" not in failure, failure
    assert "RankFailure" not in failure
    assert failure.count("rank 0 reduced to 6.0") == 1, failure
    assert "(raised on rank 0 of 4)" in failure
    for rank in (1, 2, 3):
        assert f"(rank {rank} raised too: AssertionError: rank {rank} reduced to 6.0)" in failure
    assert len(failure.splitlines()) < 40, failure
