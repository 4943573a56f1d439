"""What one ``FullyShardedDataParallel`` instance was asked for: its constructor's arguments,
checked once, in one frozen :class:`WrapperConfig`.

[Note: the wrapper's configuration]
The constructor turns its arguments into a :class:`WrapperConfig` before anything else runs,
and nothing after it reads an argument any other way: the instance's state keeps the config,
and its handle and group are built from it. Building the config checks every argument, each
error naming the argument and saying what it takes, so a wrong type or value fails here and
not deep inside the first forward.

Auto-wrapped children are built from their root's config, not by calling the constructor
again: the root makes one config for all of them (the hybrid mesh it built, its ignored
parameters, no policy), and each child changes only what it is told to, by field: a
``CustomPolicy``'s dict for that module (:meth:`WrapperConfig.with_overrides`, checked like
the constructor's arguments) and, for batch norm under mixed precision, ``mixed_precision``
turned off (see [Note: mixed precision skips batch norm] in ``reffsdp/wrap.py``).

Following ``mixed_precision``: constructor argument -> ``WrapperConfig.mixed_precision``
(checked here) -> ``WrapperState.build_group`` hands ``param_dtype`` and ``reduce_dtype`` to
the group and the config to the handle, which takes ``keep_low_precision_grads`` from it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from ..wrap import _Policy

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class MixedPrecisionDtypeError(ValueError, RuntimeError):
    """A ``MixedPrecision`` dtype that is not floating point. A bad value, so a
    ``ValueError``; torch's wrapper fails on it in its first forward or backward (a tensor
    of that dtype cannot require gradients, or be reduced into) with a ``RuntimeError``, so
    it is one too."""


@dataclass(frozen=True)
class WrapperConfig:
    """The constructor's arguments but the module, checked (see [Note: the wrapper's
    configuration]). ``None`` for ``sharding_strategy`` and ``cpu_offload`` reads as their
    defaults, as in torch's wrapper; any invalid field raises when the config is built."""

    # A ProcessGroup, a (shard, replicate) pair of them (hybrid), an object with rank() and
    # size() standing in for one (see is_stand_in), or None: the default group.
    process_group: Any = None
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    cpu_offload: CPUOffload = dataclasses.field(default_factory=CPUOffload)
    auto_wrap_policy: Callable[..., bool] | _Policy | None = None
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    # As given: None means full precision and leaves batch norm alone under auto-wrap;
    # ``precision`` is what the instance runs.
    mixed_precision: MixedPrecision | None = None
    ignored_modules: tuple[nn.Module, ...] | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    device_id: int | str | torch.device | None = None
    sync_module_states: bool = False
    forward_prefetch: bool = False
    # torch's rate limiter (at most two all-gathers ahead of compute) holds by construction
    # here: see rule 3 of [Note: why all-gathers get their own stream] in core/streams.
    limit_all_gathers: bool = True
    use_orig_params: bool = False
    ignored_states: tuple[nn.Module, ...] | tuple[nn.Parameter, ...] | None = None
    device_mesh: DeviceMesh | None = None

    def __post_init__(self) -> None:
        # The frozen dataclass's own way to settle a field while it is built: None for the
        # strategy and the offload reads as their defaults; the ignore arguments, any
        # iterable, become tuples (read once, here).
        ignored_modules, ignored_states = _ignored(self.ignored_modules, self.ignored_states)
        object.__setattr__(self, "ignored_modules", ignored_modules)
        object.__setattr__(self, "ignored_states", ignored_states)
        if self.sharding_strategy is None:
            object.__setattr__(self, "sharding_strategy", ShardingStrategy.FULL_SHARD)
        if self.cpu_offload is None:
            object.__setattr__(self, "cpu_offload", CPUOffload())
        _check_process_group(self.process_group)
        _check_type("sharding_strategy", self.sharding_strategy, ShardingStrategy)
        _check_type("cpu_offload", self.cpu_offload, CPUOffload)
        _check_auto_wrap_policy(self.auto_wrap_policy)
        _check_type("backward_prefetch", self.backward_prefetch, BackwardPrefetch)
        _check_type("mixed_precision", self.mixed_precision, MixedPrecision)
        if self.mixed_precision is not None:
            _check_mixed_precision(self.mixed_precision)
        _check_param_init_fn(self.param_init_fn)
        _check_device_id(self.device_id)
        _check_switch("sync_module_states", self.sync_module_states)
        _check_switch("forward_prefetch", self.forward_prefetch)
        _check_switch("limit_all_gathers", self.limit_all_gathers)
        _check_switch("use_orig_params", self.use_orig_params)
        _check_type("device_mesh", self.device_mesh, DeviceMesh)
        _check_mesh_arguments(self)

    @functools.cached_property
    def precision(self) -> MixedPrecision:
        """The mixed precision this instance runs: ``mixed_precision``, or
        ``MixedPrecision()`` (full precision) when none was given, as torch's wrapper shows
        it."""
        return self.mixed_precision if self.mixed_precision is not None else MixedPrecision()

    def with_overrides(self, overrides: Mapping[str, Any], where: str) -> WrapperConfig:
        """This config with ``overrides`` (constructor arguments by name, as a
        ``CustomPolicy`` gives them for the module ``where`` names) in place of its own
        fields, checked like the constructor's."""
        if not overrides:
            return self
        names = [field.name for field in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(
                f"the auto_wrap_policy gave {where} the arguments {unknown}, which "
                f"FullyShardedDataParallel does not take; it takes {names} (the module aside)"
            )
        return dataclasses.replace(self, **overrides)


# -- the checks, one per argument ----------------------------------------------------------


def _check_type(name: str, value: Any, expected: type) -> None:
    if value is None or isinstance(value, expected):
        return
    where = "reffsdp" if expected.__module__.startswith("reffsdp") else expected.__module__
    raise TypeError(f"{name} must be a {where}.{expected.__name__} or None, got {describe(value)}")


def _check_process_group(value: Any) -> None:
    groups = value if isinstance(value, tuple) else (value,)
    if value is None or all(isinstance(g, dist.ProcessGroup) for g in groups):
        return
    answers = all(callable(getattr(value, method, None)) for method in ("rank", "size"))
    if is_stand_in(value) and answers:
        return
    raise TypeError(
        "process_group must be a ProcessGroup, a (shard_group, replicate_group) pair of them "
        "for a hybrid strategy, an object with rank() and size() to decide sharding and "
        f"wrapping without communicating, or None, got {describe(value)}"
    )


def is_stand_in(process_group: Any) -> bool:
    """Whether ``process_group`` stands in for a group: neither ``None``, a ProcessGroup
    nor a hybrid pair (the config makes sure it answers ``rank()`` and ``size()``).
    torch's tests pass one to check wrapping decisions with no process group initialized;
    instances built over one never communicate."""
    return process_group is not None and not isinstance(process_group, (dist.ProcessGroup, tuple))


def _check_auto_wrap_policy(value: Any) -> None:
    """torch's wrapper calls whatever it is given: a string fails with "'str' object is not
    callable" from deep inside auto-wrapping."""
    if value is None or isinstance(value, _Policy) or callable(value):
        return
    raise TypeError(
        "auto_wrap_policy must be a policy object (ModuleWrapPolicy({...}) or "
        "CustomPolicy(...) from reffsdp.wrap), a callable (module, recurse, nonwrapped_numel) "
        "-> bool such as functools.partial(size_based_auto_wrap_policy, min_num_params=...), "
        f"or None, got {describe(value)}"
    )


def _check_mixed_precision(mixed_precision: MixedPrecision) -> None:
    """Dtypes must be torch dtypes, and floating point: torch's wrapper takes any and fails
    later (an integer ``param_dtype`` in forward: "only floating point tensors can require
    gradients"; an integer ``reduce_dtype`` in backward, casting into it)."""
    dtypes = (
        ("param_dtype", mixed_precision.param_dtype),
        ("reduce_dtype", mixed_precision.reduce_dtype),
        ("buffer_dtype", mixed_precision.buffer_dtype),
    )
    for name, value in dtypes:
        if value is None:
            continue
        if not isinstance(value, torch.dtype):
            raise TypeError(
                f"MixedPrecision's {name} must be torch.dtype (such as torch.bfloat16) or "
                f"None, got {describe(value)}"
            )
        if not value.is_floating_point:
            raise MixedPrecisionDtypeError(
                f"MixedPrecision's {name} must be a floating-point dtype (such as "
                f"torch.bfloat16 or torch.float16), got {value}: parameters, gradients and "
                "buffers keep their values in it; pass None to keep that part in full precision"
            )
    _check_switch(
        "MixedPrecision's keep_low_precision_grads", mixed_precision.keep_low_precision_grads
    )
    _check_switch("MixedPrecision's cast_forward_inputs", mixed_precision.cast_forward_inputs)
    _check_switch(
        "MixedPrecision's cast_root_forward_inputs", mixed_precision.cast_root_forward_inputs
    )


def _ignored(ignored_modules: Any, ignored_states: Any) -> tuple[tuple | None, tuple | None]:
    """The two ignore arguments as tuples (``None`` where not given), checked as torch's
    wrapper checks them, in its words: only one of them, all modules (``ignored_modules``),
    or all modules or all parameters (``ignored_states``)."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time; pass only "
            "ignored_states, which takes modules or parameters"
        )
    name = "ignored_states" if ignored_states is not None else "ignored_modules"
    given = ignored_states if ignored_states is not None else ignored_modules
    if given is None:
        return None, None
    try:
        items = tuple(given)
    except TypeError:
        kinds = "nn.Modules or of nn.Parameters" if name == "ignored_states" else "nn.Modules"
        raise TypeError(f"{name} must be an iterable of {kinds}, got {describe(given)}") from None
    types = sorted({type(x) for x in items}, key=repr)
    if name == "ignored_modules" and not all(isinstance(x, nn.Module) for x in items):
        raise ValueError(
            f"ignored_modules expects nn.Module list elements but got types {types}; to "
            "ignore single parameters pass them as ignored_states"
        )
    is_param = [isinstance(x, nn.Parameter) for x in items]
    is_module = [isinstance(x, nn.Module) for x in items]
    if not (all(is_param) or all(is_module)):
        raise ValueError(
            "ignored_states expects all nn.Parameter or all nn.Module list elements but got "
            f"types {types}; pass either the modules or their parameters"
        )
    return (None, items) if name == "ignored_states" else (items, None)


def _check_param_init_fn(value: Any) -> None:
    """torch checks only when a module is on the meta device; a wrong one is wrong anyway."""
    if value is not None and not callable(value):
        raise ValueError(
            f"Expected param_init_fn to be callable but got {describe(value)}: pass a "
            "function that takes a module and gives its meta-device parameters and buffers "
            "real storage and values, or None"
        )


def _check_device_id(value: Any) -> None:
    if value is None or isinstance(value, torch.device):
        return
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(
                f"device_id must be a device index (0 or more), got {value}; pass the index "
                "of this rank's accelerator, a torch.device, or None"
            )
        return
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            raise ValueError(
                f"device_id {value!r} names no device; pass an index, a torch.device or a "
                "device string such as 'cuda:0'"
            ) from None
        return
    raise TypeError(
        f"device_id must be an int (a device index), a torch.device or None, got {describe(value)}"
    )


def _check_switch(name: str, value: Any) -> None:
    """An on/off argument: ``True`` or ``False`` (``1`` and ``0`` pass too). torch's wrapper
    takes anything and reads it as true or false, so ``"no"`` and ``-1`` would switch on."""
    if isinstance(value, int) and value in (0, 1):  # bools are ints too
        return
    if isinstance(value, int):
        raise ValueError(f"{name} is on or off, True or False; got {value}")
    raise TypeError(f"{name} must be True or False, got {describe(value)}")


def _check_mesh_arguments(config: WrapperConfig) -> None:
    """A process group or a device mesh, not both; hybrid instances wrapped by hand must be
    handed their groups: built per instance, nothing would make them agree (an auto-wrapping
    root builds them once for all)."""
    if config.process_group is not None and config.device_mesh is not None:
        raise ValueError(
            "FullyShardedDataParallel takes a process_group or a device_mesh, not both"
        )
    strategy = config.sharding_strategy
    given = (config.process_group, config.device_mesh, config.auto_wrap_policy)
    if strategy in HYBRID and all(x is None for x in given):
        raise ValueError(
            f"Manual wrapping with {strategy} requires explicit specification of process "
            "group or device_mesh: pass process_group=(shard_group, replicate_group) or a 2-D "
            "device_mesh, the same to every instance, or wrap with an auto_wrap_policy, "
            "which builds the groups once for every instance it creates"
        )


def describe(value: Any) -> str:
    """A value for an error message: its type, and the value itself when that is short
    (never a module's repr). Types from outside reffsdp and builtins carry their module, so
    torch's ``ShardingStrategy`` does not read like reffsdp's."""
    kind = type(value)
    name = kind.__qualname__
    if kind.__module__.split(".")[0] not in ("builtins", "reffsdp"):
        name = f"{kind.__module__}.{name}"
    if isinstance(value, (str, int, float, enum.Enum)):
        return f"{name} {value!r}"
    if isinstance(value, tuple):
        return f"a tuple of {[type(v).__name__ for v in value]}"
    return name
