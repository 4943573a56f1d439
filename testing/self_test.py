"""The parity suite's self-test: plant known bugs and check the suite fails.

A passing parity suite means something only if a broken FSDP makes it fail. Each bug below
is planted for the length of a scenario (process-wide, so every rank thread sees it; in
process backends each rank process plants it in itself), never by editing an
implementation. Each runs against both APIs (the last one against ``fully_shard`` alone),
on a scenario that trains an uneven-width MLP (so padding is exercised) on the 1-D mesh,
and must make that scenario fail; the result names the check that caught it (losses,
gradients, parameters, counts or bytes).

[Note: which implementations a bug is planted in]
A bug that patches reffsdp internals exists only in reffsdp, so it is planted only when the
suite tests reffsdp. The others hold for any FSDP implementation (``ANY``): the faults in
the process group under every implementation's collectives (see [Note: where the faults
sit] in :mod:`reffsdp.testing.planted_faults`) and the test's own fp8 weight. Under
``--impl torch`` (or any implementation but reffsdp) the self-test plants those alone.

The planted bugs, and the seam each uses. In reffsdp:

* wrong gradient divide factor: ``collectives.plan_reduction`` plans a plain sum;
* skipped reduce-scatter: ``comms.reduce_scatter`` leaves each rank its own chunk;
* stale shard after the optimizer step: members all-gather a copy of their first shard;
* wrong padding on an uneven shard: members pad their gradient at the front of dim 0;
* mixed-precision reduce in the wrong dtype: ``ParamGroup._reduce_spec`` reduces in the
  compute dtype (bf16) where the policy asks for fp32;
* missing all-gather prefetch: a prefetched all-gather is dropped at the group's
  pre-backward, which gathers again (the numbers stay right; only the counts change).

In the process group, under any implementation (every collective still runs as issued, so
the counts and bytes stay right; only what the ranks receive is wrong):

* the reduce-scatter result comes back scaled by the group size;
* rank 0's gradients never reach the reduce-scatter (it sends zeros);
* the reduce-scatter leaves each rank its own chunk, unreduced;
* rank 0's shard never reaches the all-gather (it sends zeros);
* each all-gather returns the previous all-gather's result of the same shape.

In the test's own weight class, under any implementation:

* post-all-gather hook ignores ``out=`` (``fully_shard`` only, on the ``fp8-gather``
  scenario): :class:`~reffsdp.testing.low_precision.Float8GatherWeight` returns without
  refilling the unsharded weight, so every all-gather after the first leaves it holding
  what its storage held (stale or freed-and-regrown). This holds any FSDP to the all-gather
  extension contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from . import planted_faults
from .suite_backends import iter_results
from .suite_scenarios import APIS, ScenarioSpec

REFFSDP = "reffsdp"  # the implementation whose internals the reffsdp-only bugs patch
ANY = "any"  # a bug planted whatever the implementation


@dataclasses.dataclass
class SelfTestResult:
    bug: str  # e.g. "wrong gradient divide factor"
    api: str  # "fully_shard" | "wrapper"
    caught: bool
    caught_by: str  # the check that caught it
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- the bugs -------------------------------------------------------------------------------


@contextlib.contextmanager
def _sum_without_divide() -> Iterator[None]:
    from reffsdp.core import collectives

    original = collectives.plan_reduction
    sum_op = dist.ReduceOp.SUM

    def plan_reduction(*args: Any, **kwargs: Any) -> Any:
        plan = original(*args, **kwargs)
        return dataclasses.replace(
            plan,
            reduce_scatter_op=sum_op,
            all_reduce_op=sum_op,
            pre_factor=None,
            post_factor=None,
            premul_factor=None,
            copy_divisor=None,
        )

    with mock.patch.object(collectives, "plan_reduction", plan_reduction):
        yield


@contextlib.contextmanager
def _skip_reduce_scatter() -> Iterator[None]:
    from reffsdp.core import comms

    def reduce_scatter(output, input, group, *, op=None, async_op=False):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        output.copy_(input.view(size, -1)[rank])
        return None

    with mock.patch.object(comms, "reduce_scatter", reduce_scatter):
        yield


def _member_classes() -> list[type]:
    from reffsdp.per_param.sharded_param import ShardedParam
    from reffsdp.wrapper.flat_param import FlatParamHandle

    return [ShardedParam, FlatParamHandle]


@contextlib.contextmanager
def _stale_all_gather_input() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for cls in _member_classes():
            original = cls.all_gather_input

            def all_gather_input(self: Any, _original: Callable = original) -> torch.Tensor:
                stale = self.__dict__.get("_planted_stale_shard")
                if stale is None:
                    stale = self.__dict__["_planted_stale_shard"] = _original(self).clone()
                return stale

            stack.enter_context(mock.patch.object(cls, "all_gather_input", all_gather_input))
        yield


@contextlib.contextmanager
def _front_padding() -> Iterator[None]:
    from reffsdp.per_param.sharded_param import ShardedParam
    from reffsdp.wrapper.flat_param import FlatParamHandle

    per_param = ShardedParam.take_grad_for_reduce
    flat = FlatParamHandle.take_grad_for_reduce

    def per_param_grad(self: Any, zeros_if_unused: bool) -> torch.Tensor | None:
        grad = per_param(self, zeros_if_unused)
        if grad is None or grad.dim() == 0:
            return grad
        world_size = self.layout.world_size
        pad = -grad.shape[0] % world_size
        if not pad:
            return grad
        zeros = grad.new_zeros((pad, *grad.shape[1:]))
        return torch.cat([zeros, grad])

    def flat_grad(self: Any, zeros_if_unused: bool) -> torch.Tensor | None:
        grad = flat(self, zeros_if_unused)
        pad = self.layout.padded_numel - self.layout.total_numel
        if grad is None or not pad:
            return grad
        return torch.cat([grad.new_zeros(pad), grad[: self.layout.total_numel]])

    with (
        mock.patch.object(ShardedParam, "take_grad_for_reduce", per_param_grad),
        mock.patch.object(FlatParamHandle, "take_grad_for_reduce", flat_grad),
    ):
        yield


@contextlib.contextmanager
def _reduce_in_compute_dtype() -> Iterator[None]:
    from reffsdp.core.param_group import ParamGroup

    original = ParamGroup._reduce_spec

    def reduce_spec(self: Any, members: list, grads: list) -> Any:
        spec = original(self, members, grads)
        return dataclasses.replace(spec, reduce_dtype=members[0].compute_dtype)

    with mock.patch.object(ParamGroup, "_reduce_spec", reduce_spec):
        yield


@contextlib.contextmanager
def _drop_backward_prefetch() -> Iterator[None]:
    from reffsdp.core.param_group import ParamGroup
    from reffsdp.core.states import TrainingState

    original = ParamGroup.pre_backward

    def pre_backward(self: Any) -> None:
        if self.training_state is not TrainingState.PRE_BACKWARD:
            self._drop_unconsumed_all_gather()
        original(self)

    with mock.patch.object(ParamGroup, "pre_backward", pre_backward):
        yield


@contextlib.contextmanager
def _post_all_gather_ignores_out() -> Iterator[None]:
    from .low_precision import Float8GatherWeight

    original = Float8GatherWeight.fsdp_post_all_gather

    def fsdp_post_all_gather(
        self: Any, outputs: Any, metadata: Any, param_dtype: Any, *, out: Any = None
    ) -> Any:
        if out is not None:
            return None  # the bug: the refill is skipped
        return original(self, outputs, metadata, param_dtype)

    with mock.patch.object(Float8GatherWeight, "fsdp_post_all_gather", fsdp_post_all_gather):
        yield


@dataclasses.dataclass(frozen=True)
class PlantedBug:
    name: str
    plant: Callable[[], AbstractContextManager[Any]]
    feature: str = "fp32"  # the scenario feature it needs
    apis: tuple[str, ...] = APIS  # those whose scenario has the feature
    impl: str = REFFSDP  # the implementation it exists in, or ANY

    def applies_to(self, impl: str) -> bool:
        """Whether the bug is planted when the suite tests ``impl`` (see [Note: which
        implementations a bug is planted in])."""
        return self.impl in (ANY, impl)


BUGS: tuple[PlantedBug, ...] = (
    PlantedBug("wrong gradient divide factor", _sum_without_divide),
    PlantedBug("skipped reduce-scatter", _skip_reduce_scatter),
    PlantedBug("stale shard after the optimizer step", _stale_all_gather_input),
    PlantedBug("wrong padding on an uneven shard", _front_padding),
    PlantedBug("mixed-precision reduce in the wrong dtype", _reduce_in_compute_dtype, "bf16"),
    PlantedBug("missing all-gather prefetch", _drop_backward_prefetch),
    PlantedBug(
        "reduce-scatter result scaled by the group size",
        planted_faults.reduce_scatter_scaled,
        impl=ANY,
    ),
    PlantedBug(
        "reduce-scatter drops rank 0's gradients",
        planted_faults.reduce_scatter_drops_a_rank,
        impl=ANY,
    ),
    PlantedBug(
        "reduce-scatter skipped, each rank keeps its own chunk",
        planted_faults.reduce_scatter_skipped,
        impl=ANY,
    ),
    PlantedBug("all-gather drops rank 0's shard", planted_faults.all_gather_drops_a_rank, impl=ANY),
    PlantedBug(
        "all-gather returns the previous call's result",
        planted_faults.all_gather_stale,
        impl=ANY,
    ),
    PlantedBug(
        "post-all-gather hook ignores out=",
        _post_all_gather_ignores_out,
        "fp8-gather",
        ("fully_shard",),
        impl=ANY,
    ),
)


def bug_context(name: str) -> Callable[[], AbstractContextManager[Any]]:
    """The context manager factory that plants the bug called ``name``."""
    for bug in BUGS:
        if bug.name == name:
            return bug.plant
    raise ValueError(f"no planted bug named {name!r}; known: {[b.name for b in BUGS]}")


def self_test_spec(bug: PlantedBug, api: str) -> ScenarioSpec:
    """The scenario a bug is planted into: an uneven-width MLP on the 1-D mesh."""
    return ScenarioSpec(api, "1d", bug.feature, "mlp")


# -- running --------------------------------------------------------------------------------


def list_self_test(options: Any, *, impl: Any = None) -> list[tuple[str, str]]:
    """``(bug, api)`` of every planted bug :func:`iter_self_test` runs, in its order.

    ``impl``: the implementation under test, by its ``--impl`` name (``"reffsdp"``,
    ``"torch"``, a module path) or any object with that ``name``; by default
    ``options.impl`` where the options have one, else reffsdp. Only reffsdp gets the bugs
    that patch reffsdp internals.
    """
    impl_name = _impl_name(options, impl)
    return [(bug.name, api) for bug in _bugs_for(impl_name) for api in _apis_of(bug, options)]


def _impl_name(options: Any, impl: Any) -> str:
    chosen = impl if impl is not None else getattr(options, "impl", None)
    if chosen is None:
        return REFFSDP
    return chosen if isinstance(chosen, str) else chosen.name


def _bugs_for(impl_name: str) -> list[PlantedBug]:
    return [bug for bug in BUGS if bug.applies_to(impl_name)]


def _self_test_apis(options: Any) -> tuple[str, ...]:
    unknown = sorted(set(options.api) - set(APIS))
    if unknown:
        raise ValueError(f"the self-test plants bugs in {list(APIS)} only, not in {unknown}")
    return options.api or APIS


def _apis_of(bug: PlantedBug, options: Any) -> list[str]:
    """The APIs of ``options`` that ``bug`` is planted in, in ``options``' order."""
    return [api for api in _self_test_apis(options) if api in bug.apis]


def iter_self_test(options: Any, *, impl: Any = None) -> Iterator[SelfTestResult]:
    """Plant every bug that applies to ``impl`` (see :func:`list_self_test`) against each
    API of ``options.api`` (all when empty) on ``options.backend``; each must make its
    scenario fail. Yields each bug's outcome as it finishes, in :func:`list_self_test`'s
    order.

    The unpatched scenarios run first: a bug counts as caught only when the same scenario
    passes without it.
    """
    bugs = _bugs_for(_impl_name(options, impl))
    steps = max(2, options.steps)  # a stale shard shows from the second step on
    options = dataclasses.replace(options, steps=steps)
    baseline_specs = sorted(
        {self_test_spec(bug, api) for bug in bugs for api in _apis_of(bug, options)},
        key=lambda s: s.name,
    )
    baseline = {result.name: result for result in iter_results(baseline_specs, options)}
    for bug in bugs:
        specs = [self_test_spec(bug, api) for api in _apis_of(bug, options)]
        if not specs:
            continue
        start = time.perf_counter()
        for spec, result in zip(specs, iter_results(specs, options, bug.plant)):
            caught, caught_by = _verdict(spec, baseline[spec.name], result)
            yield SelfTestResult(
                bug=bug.name,
                api=spec.api,
                caught=caught,
                caught_by=caught_by,
                seconds=result.seconds or (time.perf_counter() - start),
            )
            start = time.perf_counter()


def _verdict(spec: ScenarioSpec, clean: Any, planted: Any) -> tuple[bool, str]:
    """Whether the bug was caught, and by what (or why not)."""
    if clean.status != "passed":
        return False, (
            f"inconclusive: the unpatched scenario {spec.name} is {clean.status}: {clean.message}"
        )
    if planted.status == "failed":
        return True, planted.message
    return False, f"scenario {spec.name} {planted.status} with the bug"


def run_self_test(
    options: Any,
    on_result: Callable[[SelfTestResult], None] | None = None,
    *,
    impl: Any = None,
) -> list[SelfTestResult]:
    """Every outcome of :func:`iter_self_test` (for ``impl``, as there); ``on_result`` is
    called in this process as each bug finishes."""
    results = []
    for outcome in iter_self_test(options, impl=impl):
        results.append(outcome)
        if on_result is not None:
            on_result(outcome)
    return results
