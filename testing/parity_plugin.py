"""The parity suite as a pytest session: one test per scenario, run by ``pytest.main``.

``python -m reffsdp.testing`` builds a :class:`ParityPlugin` for its options and hands it to
``pytest.main`` with the test module :mod:`reffsdp.testing.parity_tests`. pytest then does
what it does for any suite: parametrizes the tests (ids are the scenario names; each test is
marked with its API and its mesh, so ``-m "wrapper and hsdp"`` selects), selects, runs,
writes JUnit XML (``--junit-xml``), stops on Ctrl-C. The plugin supplies the parameters and
the results; the command line prints its own lines and table and writes the JSON from
:attr:`ParityPlugin.results`.

[Note: results arrive in their own order]
The engine (:mod:`reffsdp.testing.parity_suite`) runs every selected scenario in one
stream: threaded ranks run each scenario when its test asks for it, rank processes are
started once and report the scenarios they cannot hold first. So each test looks its result
up by name (:class:`ResultStream`), reading the stream until it arrives, and the run needs
pytest's collection order and nothing else.

[Note: the test module is handed to pytest]
pytest imports a test file by its path and names the module after the folders with an
``__init__.py`` above it. Installed from a checkout (``pip install -e``), this package's
folder is ``testing/``, not ``reffsdp/testing/``, so pytest would import a second copy of
the whole package as ``testing``. The plugin gives pytest the module already imported
instead (:meth:`ParityPlugin.pytest_pycollect_makemodule`), and a plain folder node for its
folder, whose package setup would import ``testing/__init__.py`` a second time.
"""

from __future__ import annotations

import dataclasses
import glob
import traceback
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from . import parity_tests
from .suite_scenarios import MESHES, SUITE_APIS

PLUGIN_NAME = "reffsdp-parity"
MODULE_PATH = Path(parity_tests.__file__).resolve()
SCENARIO_TEST = "test_scenario"
SELF_TEST = "test_planted_bug"


class ResultStream:
    """Results read from an iterator and handed out by key (see [Note: results arrive in
    their own order])."""

    def __init__(self, results: Iterator[Any], key: Callable[[Any], Hashable]) -> None:
        self._results = results
        self._key = key
        self._arrived: dict[Hashable, Any] = {}

    def get(self, wanted: Hashable) -> Any:
        while wanted not in self._arrived:
            try:
                result = next(self._results)
            except StopIteration:
                raise RuntimeError(f"the parity suite ended with no result for {wanted}") from None
            self._arrived[self._key(result)] = result
        return self._arrived.pop(wanted)

    def close(self) -> None:
        """Stop the engine (rank processes are stopped as its iterator closes)."""
        close = getattr(self._results, "close", None)
        if close is not None:
            close()


@dataclasses.dataclass(frozen=True)
class PlantedBugCase:
    """One planted bug against one API: a parameter of :data:`SELF_TEST`."""

    bug: str
    api: str

    @property
    def name(self) -> str:
        return f"{self.api}: {self.bug}"


class ParityPlugin:
    """The parameters, results and report hooks of one run of the suite.

    ``test`` is the test the run is for, :data:`SCENARIO_TEST` or :data:`SELF_TEST`;
    ``engine`` is :mod:`reffsdp.testing.parity_suite` (or a stand-in with its
    ``list_scenarios``, ``iter_suite``, ``list_self_test`` and ``iter_self_test``);
    ``on_collected(count)`` is called once pytest has selected the tests, ``on_result(index,
    result)`` as each result arrives; ``properties`` are written as the JUnit test suite's
    properties.
    """

    def __init__(
        self,
        test: str,
        engine: ModuleType,
        options: Any,
        *,
        on_collected: Callable[[int], None] | None = None,
        on_result: Callable[[int, Any], None] | None = None,
        properties: Sequence[tuple[str, str]] = (),
    ) -> None:
        if test not in (SCENARIO_TEST, SELF_TEST):
            raise ValueError(f"test must be {SCENARIO_TEST!r} or {SELF_TEST!r}, got {test!r}")
        self.test = test
        self.engine = engine
        self.options = options
        self.on_collected = on_collected
        self.on_result = on_result
        self.properties = tuple(properties)
        self.results: list[Any] = []
        self.selected: list[str] = []  # test parameters' names, after pytest's selection
        self.error: str | None = None  # the engine's traceback, when it raised
        self.interrupted = False
        self._stream: ResultStream | None = None

    # -- collection ----------------------------------------------------------------------

    def pytest_configure(self, config: pytest.Config) -> None:
        for api in SUITE_APIS:
            config.addinivalue_line("markers", f"{api}: a scenario of the {api} API")
        for mesh in MESHES:
            config.addinivalue_line("markers", f"{mesh}: a scenario on the {mesh} mesh")

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path: Path, parent: pytest.Collector) -> Any:
        if path.resolve() == MODULE_PATH.parent:  # [Note: the test module is handed to pytest]
            return pytest.Dir.from_parent(parent, path=path)
        return None

    @pytest.hookimpl(tryfirst=True)
    def pytest_pycollect_makemodule(self, module_path: Path, parent: pytest.Collector) -> Any:
        if module_path.resolve() != MODULE_PATH:
            return None
        module = pytest.Module.from_parent(parent, path=module_path)
        module.obj = parity_tests  # [Note: the test module is handed to pytest]
        return module

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if metafunc.function.__name__ != self.test:
            return  # not this run's test: left out by its node id
        if "scenario" in metafunc.fixturenames:
            scenarios = self.engine.list_scenarios(self.options)
            params = [
                pytest.param(s, id=s.name, marks=[getattr(pytest.mark, s.api), _mesh_mark(s)])
                for s in scenarios
            ]
            metafunc.parametrize("scenario", params)
        if "planted_bug" in metafunc.fixturenames:
            cases = [
                PlantedBugCase(bug, api) for bug, api in self.engine.list_self_test(self.options)
            ]
            params = [pytest.param(c, id=c.name, marks=getattr(pytest.mark, c.api)) for c in cases]
            metafunc.parametrize("planted_bug", params)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            callspec = getattr(item, "callspec", None)
            if callspec is not None:
                param = callspec.params.get("scenario") or callspec.params.get("planted_bug")
                self.selected.append(param.name)
        if self.on_collected is not None:
            self.on_collected(len(self.selected))

    # -- results -------------------------------------------------------------------------

    @pytest.fixture
    def parity_run(self) -> ParityPlugin:
        return self

    @pytest.fixture(scope="session", autouse=True)
    def _suite_properties(self, record_testsuite_property: Callable[[str, object], None]) -> None:
        for name, value in self.properties:
            record_testsuite_property(name, value)

    def result_of_scenario(self, name: str, session: pytest.Session) -> Any:
        """The result of the scenario called ``name``, run (or read) now."""
        if self._stream is None:
            # The scenarios pytest kept (after -m, -k) and no others: names as exact globs.
            kept = tuple(glob.escape(selected) for selected in self.selected)
            options = dataclasses.replace(self.options, only=kept)
            self._stream = ResultStream(self.engine.iter_suite(options), _name_of)
        return self._take(name, session)

    def result_of_planted_bug(self, case: PlantedBugCase, session: pytest.Session) -> Any:
        """Whether the suite caught the planted bug ``case``."""
        if self._stream is None:
            results = self.engine.iter_self_test(self.options)
            self._stream = ResultStream(results, lambda r: PlantedBugCase(r.bug, r.api))
        return self._take(case, session)

    def _take(self, key: Hashable, session: pytest.Session) -> Any:
        assert self._stream is not None
        try:
            result = self._stream.get(key)
        except Exception:
            self.error = traceback.format_exc()
            session.shouldfail = "the parity suite stopped with an error"
            raise
        self.results.append(result)
        if self.on_result is not None:
            self.on_result(len(self.results), result)
        return result

    # -- the end -------------------------------------------------------------------------

    def pytest_keyboard_interrupt(self) -> None:
        self.interrupted = True

    def pytest_internalerror(self, excrepr: Any) -> None:
        self.error = str(excrepr)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.error = str(report.longrepr)

    def pytest_sessionfinish(self) -> None:
        if self._stream is not None:
            self._stream.close()


def _name_of(result: Any) -> str:
    return result.name


def _mesh_mark(scenario: Any) -> pytest.MarkDecorator:
    return getattr(pytest.mark, scenario.mesh)
