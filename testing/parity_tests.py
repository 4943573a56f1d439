"""The parity suite's tests: one per scenario, one per planted bug of the self-test.

``python -m reffsdp.testing`` runs this module under ``pytest.main`` with a
:class:`~reffsdp.testing.parity_plugin.ParityPlugin`, which parametrizes the tests (``scenario``
and ``planted_bug``: ids are the names, marks the API and the mesh) and supplies
``parity_run``. pytest arguments after ``--`` reach pytest itself::

    python -m reffsdp.testing -- -m "wrapper and hsdp" -x

A scenario's result is fetched while its test is set up, so an engine that stops with an
error is a test *error* in the JUnit report, and a scenario that fails its checks is a test
*failure*. One the implementation refuses to set up, and one of an API it lacks, is a test
*skipped* with ``unsupported:`` or ``not applicable:`` and the reason (the command line
still fails the run on an unsupported one, unless ``--allow-unsupported``). Every test
prints its numbers, which JUnit keeps as the test's ``system-out``.
"""

from __future__ import annotations

from typing import Any

import pytest

from . import report


@pytest.fixture
def scenario_result(scenario: Any, parity_run: Any, request: pytest.FixtureRequest) -> Any:
    return parity_run.result_of_scenario(scenario.name, request.session)


@pytest.fixture
def planted_bug_result(planted_bug: Any, parity_run: Any, request: pytest.FixtureRequest) -> Any:
    return parity_run.result_of_planted_bug(planted_bug, request.session)


def test_scenario(scenario: Any, scenario_result: Any, record_xml_attribute: Any) -> None:
    """Sharded training agrees with DDP: numbers, collective counts and bytes."""
    record_xml_attribute("classname", f"parity.{scenario.api}.{scenario.mesh}")
    record_xml_attribute("name", scenario.name)
    print(report.metrics_line(scenario_result))
    if scenario_result.status == report.SKIPPED:
        pytest.skip(scenario_result.message)
    if scenario_result.status == report.UNSUPPORTED:  # the command line fails on it
        pytest.skip(f"unsupported: {scenario_result.message}")
    if scenario_result.status == report.NOT_APPLICABLE:
        pytest.skip(f"not applicable: {scenario_result.message}")
    if report.is_failure(scenario_result.status):
        pytest.fail(report.failure_text(scenario_result), pytrace=False)


def test_planted_bug(planted_bug: Any, planted_bug_result: Any, record_xml_attribute: Any) -> None:
    """The suite catches a bug planted in the sharding code: some check fails."""
    record_xml_attribute("classname", f"self_test.{planted_bug.api}")
    record_xml_attribute("name", planted_bug.bug)
    if not planted_bug_result.caught:
        pytest.fail(
            f"{planted_bug.api}: {planted_bug.bug}: no check of the parity suite failed "
            f"({planted_bug_result.caught_by})",
            pytrace=False,
        )
    print(f"caught by {planted_bug_result.caught_by}")
