"""The parity suite: sharded training against ``DistributedDataParallel``, scenario by scenario.

Each scenario (see :mod:`reffsdp.testing.suite_scenarios` for the matrix) builds a model,
copies it for the DDP reference, shards the original with ``fully_shard`` or the
``FullyShardedDataParallel`` wrapper, and trains both, comparing losses, gradients and
parameters at every step and counting the collectives reffsdp issues
(:mod:`reffsdp.testing.suite_rank`). A scenario passes when the numbers agree AND the
collectives per step equal the expected counts AND the bytes sent equal the analytic
minimum::

    from reffsdp.testing.parity_suite import SuiteOptions, run_suite
    results = run_suite(SuiteOptions(backend="threaded", mesh=("1d",)))

This module is the suite's front: which scenarios ``options`` select, running them
(:mod:`reffsdp.testing.suite_backends` says where: threaded ranks, gloo or nccl processes),
the self-test (:mod:`reffsdp.testing.self_test`), and the scenarios on a user's own model
for a user's own tests (:func:`parity_scenarios`). ``SuiteOptions(impl="torch")`` and
``parity_scenarios(..., impl="torch")`` check another FSDP implementation than reffsdp
(:mod:`reffsdp.testing.impls`: ``torch``'s own, or any module exporting its names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .impls import DEFAULT, load_implementation
from .preflight import check_block_types
from .self_test import (
    SelfTestResult,
    bug_context,
    iter_self_test,
    list_self_test,
    run_self_test,
)
from .suite_backends import ScenarioInfo, SuiteOptions, run_threaded_one, scenario_info
from .suite_backends import iter_results as _iter_results
from .suite_rank import ScenarioResult, run_scenario
from .suite_scenarios import (
    APIS,
    CUSTOM_FEATURES,
    CUSTOM_OPTIONAL_FEATURES,
    FEATURES,
    MESHES,
    WRAPPER_MESHES,
    CustomModel,
    ScenarioSpec,
    all_specs,
    select,
)
from .tolerances import Tolerance


def _selected(options: SuiteOptions) -> list[ScenarioSpec]:
    return select(
        all_specs(),
        api=options.api,
        mesh=options.mesh,
        only=options.only,
        exclude=options.exclude,
    )


def list_scenarios(options: SuiteOptions) -> list[ScenarioInfo]:
    """The scenarios ``options`` selects, in run order (see [Note: the matrix] in
    :mod:`reffsdp.testing.suite_scenarios`; the wrapper has no tensor-parallel meshes)."""
    return [scenario_info(spec, options) for spec in _selected(options)]


def iter_results(
    specs: Sequence[ScenarioSpec], options: SuiteOptions, bug_name: str | None = None
) -> Iterator[ScenarioResult]:
    """Run ``specs`` on ``options.backend``, with the planted bug called ``bug_name`` (see
    :mod:`reffsdp.testing.self_test`) when given; yields each result as it finishes."""
    bug = None if bug_name is None else bug_context(bug_name)
    return _iter_results(specs, options, bug)


def iter_suite(options: SuiteOptions) -> Iterator[ScenarioResult]:
    """Run every scenario :func:`list_scenarios` lists, on ``options.backend``, yielding each
    result as it finishes (process backends report the scenarios they skip first)."""
    return _iter_results(_selected(options), options)


def run_suite(
    options: SuiteOptions,
    on_result: Callable[[ScenarioResult], None] | None = None,
) -> list[ScenarioResult]:
    """Every result of :func:`iter_suite`, in the order they finished.

    ``on_result`` is called in this process as each scenario finishes. A scenario whose
    collective counts differ from the expected counts, or whose bytes differ from the
    analytic minimum, is "failed" even when every number matches DDP.
    """
    results = []
    for result in iter_suite(options):
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


# -- for users: the scenarios on their own model ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParityScenario:
    """One parity scenario to run in a user's own tests (see :func:`parity_scenarios`).

    :meth:`run` runs it on every rank of an initialized default group (inside
    ``FSDPTestMultiThread`` or ``FSDPTest``); :meth:`run_threaded` starts a threaded world of
    :attr:`world_size` ranks itself, for a plain pytest function. Either returns a
    :class:`ScenarioResult`; ``status == "passed"`` is what to assert.
    """

    spec: ScenarioSpec
    world_size: int
    steps: int = 3
    seed: int = 0
    impl: str = DEFAULT  # the FSDP implementation that shards (reffsdp.testing.impls)

    @property
    def name(self) -> str:
        return self.spec.name

    def __str__(self) -> str:
        return self.name

    def run(self, device: torch.device | str | None = None) -> ScenarioResult:
        if device is None:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return run_scenario(
            self.spec, torch.device(device), steps=self.steps, seed=self.seed, impl=self.impl
        )

    def run_threaded(self, device: str = "cpu") -> ScenarioResult:
        options = SuiteOptions(
            device=device,
            world_size=self.world_size,
            steps=self.steps,
            seed=self.seed,
            impl=self.impl,
        )
        return run_threaded_one(self.spec, options)


def parity_scenarios(
    model_factory: Callable[[], torch.nn.Module] | None = None,
    make_inputs: Callable[[int, int], Any] | None = None,
    *,
    block_types: Sequence[type[torch.nn.Module]] = (),
    apis: Sequence[str] = APIS,
    meshes: Sequence[str] | None = None,
    features: Sequence[str] | None = None,
    world_size: int = 4,
    steps: int = 3,
    seed: int = 0,
    name: str = "custom",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
    rtol: Tolerance = None,
    atol: Tolerance = None,
    impl: str = DEFAULT,
) -> list[ParityScenario]:
    """Parity scenarios to run in your own test suite.

    Without ``model_factory``: the suite's own matrix, filtered by ``apis``, ``meshes`` and
    ``features``. With it: your model under both APIs (or ``apis``), on the ``1d`` and
    ``hsdp`` meshes (or ``meshes``), with the features ``fp32``, ``reshard``, ``accum``,
    ``offload``, ``sd-full`` and ``sd-sharded`` (or ``features``; ``bf16`` and
    ``orig-params`` may be added; ``orig-params`` runs under the wrapper only).
    ``model_factory()`` builds the unsharded model on the CPU; each scenario builds it seeded
    and then copies rank 0's weights to every rank, so a factory that draws its weights from
    torch's RNG gives every rank the same model. ``make_inputs(iteration, rank)`` returns one
    forward's inputs: a tensor, a tuple of positional arguments or a dict of keyword
    arguments, tensors nested in them moved to the scenario's device. Each module of
    ``block_types`` is sharded (or wrapped) on its own before the root; classes that match
    no module fail the scenario, as does a block left unsharded.

    ``loss_fn`` maps the model's output to a scalar (default: the sum of every output
    tensor; a model returning an output object needs one, e.g. ``lambda out: out.loss``);
    ``optimizer_factory`` builds an optimizer from parameters (default: plain SGD,
    ``lr=1e-3``); ``rtol``/``atol`` replace the default tolerance, which is derived from
    the dtype and the world size (see [Note: default tolerances] in
    :mod:`reffsdp.testing.tolerances`), with one number for every dtype or a mapping per
    dtype. The scenario names read ``"<api>/<mesh>/<feature>/<name>"``.

    ``impl`` is the FSDP implementation that shards: ``"reffsdp"`` (default), ``"torch"``
    (``torch.distributed.fsdp`` as installed) or the dotted path of a module that exports
    its names (see :mod:`reffsdp.testing.impls`). A scenario of an API it lacks runs to
    the status ``"not_applicable"``, one it refuses to set up to ``"unsupported"`` (with
    its message); neither is ``"passed"``.

    Unknown ``apis``, ``meshes`` or ``features``, an implementation that cannot be loaded,
    and a selection that leaves no scenario raise ``ValueError``.
    """
    load_implementation(impl)  # ImplementationError (a ValueError) for an unknown one
    if (model_factory is None) != (make_inputs is None):
        raise ValueError("pass both model_factory and make_inputs, or neither")
    unknown = sorted(set(apis) - set(APIS))
    if unknown:
        raise ValueError(f"unknown API(s) {unknown}; pick from {list(APIS)}")
    if model_factory is None:
        custom_options = {
            "block_types": block_types,
            "loss_fn": loss_fn,
            "optimizer_factory": optimizer_factory,
            "rtol": rtol,
            "atol": atol,
        }
        given = [key for key, value in custom_options.items() if value not in (None, ())]
        if given:
            raise ValueError(f"{', '.join(given)} apply to your own model: pass model_factory")
        specs = _suite_specs(apis, meshes, features)
    else:
        assert make_inputs is not None
        custom = CustomModel(
            model_factory,
            make_inputs,
            check_block_types(block_types),
            loss_fn=loss_fn,
            optimizer_factory=optimizer_factory,
            rtol=rtol,
            atol=atol,
        )
        specs = _custom_specs(custom, name, apis, meshes, features)
    if not specs:
        raise ValueError(
            f"no scenario runs apis={list(apis)}, meshes={meshes}, features={features} "
            "(orig-params runs under the wrapper only)"
        )
    options = SuiteOptions(world_size=world_size)
    return [
        ParityScenario(
            spec, spec.world_size(world_size, resize=options.resizes_worlds), steps, seed, impl
        )
        for spec in specs
    ]


def _suite_specs(
    apis: Sequence[str], meshes: Sequence[str] | None, features: Sequence[str] | None
) -> list[ScenarioSpec]:
    """The suite's own scenarios of ``apis``, ``meshes`` and ``features`` (``None``: all)."""
    _check_features(features, FEATURES)
    specs = select(all_specs(), api=tuple(apis), mesh=tuple(meshes or ()))
    if features is not None:
        specs = [spec for spec in specs if spec.feature in features]
    return specs


def _custom_specs(
    custom: CustomModel,
    name: str,
    apis: Sequence[str],
    meshes: Sequence[str] | None,
    features: Sequence[str] | None,
) -> list[ScenarioSpec]:
    """A user's model under ``apis``, on ``meshes`` (a custom model has no tensor-parallel
    plan, so 1-D and HSDP only), with ``features`` (``None``: the defaults)."""
    _check_features(features, (*CUSTOM_FEATURES, *CUSTOM_OPTIONAL_FEATURES))
    wanted_meshes = tuple(meshes or WRAPPER_MESHES)
    bad = sorted(set(wanted_meshes) - set(WRAPPER_MESHES))
    if bad:
        raise ValueError(
            f"mesh(es) {bad} need a tensor-parallel plan for your model; a custom model "
            f"runs on {list(WRAPPER_MESHES)}"
        )
    return [
        ScenarioSpec(api, mesh, feature, name, custom=custom)
        for api in apis
        for mesh in wanted_meshes
        for feature in features or CUSTOM_FEATURES
        if feature != "orig-params" or api == "wrapper"  # the wrapper's option alone
    ]


def _check_features(features: Sequence[str] | None, known: Sequence[str]) -> None:
    if isinstance(features, str):
        raise TypeError(f"features is a sequence of names, e.g. [{features!r}], not a string")
    unknown = sorted(set(features or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; pick from {list(known)}")


__all__ = [
    "MESHES",
    "ParityScenario",
    "ScenarioInfo",
    "ScenarioResult",
    "SelfTestResult",
    "SuiteOptions",
    "iter_results",
    "iter_self_test",
    "iter_suite",
    "list_scenarios",
    "list_self_test",
    "parity_scenarios",
    "run_scenario",
    "run_self_test",
    "run_suite",
]
