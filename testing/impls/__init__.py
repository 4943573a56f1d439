"""The FSDP implementation the parity suite checks: reffsdp, torch's own, or any module.

[Note: an implementation]
An implementation is a module that exports torch's public FSDP names, those of
``torch.distributed.fsdp``: the per-parameter API (:data:`FULLY_SHARD_NAMES`) and the
wrapper API (:data:`WRAPPER_NAMES`), or one of them. ``python -m reffsdp.testing --impl
NAME`` and ``parity_scenarios(..., impl=NAME)`` take its name: ``reffsdp`` (the default),
``torch`` (``torch.distributed.fsdp`` as installed, presented by
:mod:`reffsdp.testing.impls.torch_fsdp`) or the dotted path of any importable module (a
fork, or your own). The suite shards every model through these names alone, so a
scenario holds any implementation to the same checks: the same numbers as DDP, the
collectives and bytes the strategy calls for.

An API whose names a module lacks is *not applicable*: its scenarios are listed as such,
with the names missing, and never count as passed. The ``naive`` scenarios train
:class:`reffsdp.naive.NaiveFSDP`, reffsdp's one-page FSDP, which no other implementation
has: they are not applicable to any but reffsdp.

What the suite does differently for one implementation is decided here and nowhere else:

1. the wrapper's extra arguments (:attr:`Implementation.wrapper_kwargs`; torch's wrapper
   is told its device on CPU, see ``torch_fsdp.py``);
2. how its collectives are observed: reffsdp's through its comms seam, any other's
   through what ``torch.distributed`` issues (:meth:`Implementation.observe_collectives`);
3. reffsdp's one size handshake for all-gather extensions (``handshakes`` in
   :mod:`reffsdp.testing.expected_comms`), expected only of reffsdp's ``fully_shard``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from reffsdp.core.comms import Collective

DEFAULT = "reffsdp"
FULLY_SHARD_NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")
WRAPPER_NAMES = (
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
)
NAMES_OF_API = {"fully_shard": FULLY_SHARD_NAMES, "wrapper": WRAPPER_NAMES}

# observer(kind, nbytes of the unsharded side, size of the group it ran on)
Observer = Callable[[Collective, int, int], None]


class ImplementationError(ValueError):
    """The name given does not lead to an FSDP implementation the suite can check."""


def _no_kwargs(device: torch.device) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One FSDP implementation under test; see [Note: an implementation]."""

    name: str  # as given: "reffsdp", "torch" or a module path
    version: str
    module: ModuleType  # exports the names of torch.distributed.fsdp
    # (api, why its scenarios are not applicable) for each API the module lacks
    missing: tuple[tuple[str, str], ...] = ()
    # Expect reffsdp's size handshake for all-gather extensions (point 3 of the note).
    size_handshakes: bool = False
    # Arguments the wrapper gets besides the scenario's own, given the scenario's device.
    wrapper_kwargs: Callable[[torch.device], dict[str, Any]] = _no_kwargs
    # Observe its collectives through reffsdp's comms seam (point 2 of the note).
    through_reffsdp_seam: bool = False

    @property
    def label(self) -> str:
        """``torch 2.13.0``: the name and the version, for the reports."""
        return f"{self.name} {self.version}"

    def not_applicable(self, api: str) -> str:
        """Why this implementation has no scenarios of ``api`` (``""`` when it has)."""
        if api == "naive":
            if self.name == DEFAULT:
                return ""
            return (
                "the naive scenarios train reffsdp.naive.NaiveFSDP, reffsdp's one-page FSDP, "
                f"which is not part of the FSDP API that {self.name} is checked through; "
                "they run under --impl reffsdp"
            )
        return dict(self.missing).get(api, "")

    def observe_collectives(self, observer: Observer) -> AbstractContextManager[Any]:
        """Call ``observer`` at each all-gather, reduce-scatter and all-reduce this
        implementation issues on the calling rank while the context is open."""
        if self.through_reffsdp_seam:
            from ..patching import observe_collectives

            def through_seam(kind: Collective, tensor: torch.Tensor, group: Any) -> None:
                observer(kind, tensor.numel() * tensor.element_size(), dist.get_world_size(group))

            return observe_collectives(through_seam)
        from ..comm_counter import IssuedCollectives

        return IssuedCollectives(observer)


@functools.cache
def load_implementation(name: str = DEFAULT) -> Implementation:
    """The implementation called ``name``; :class:`ImplementationError` when there is none.

    ``reffsdp``, ``torch`` or an importable module path (see [Note: an implementation]).
    """
    if not isinstance(name, str) or not name.strip():
        raise ImplementationError(
            f"an implementation is named by a string (reffsdp, torch or a module path), "
            f"got {name!r}"
        )
    if name == DEFAULT:
        import reffsdp

        return from_module(name, reffsdp, _distribution_version("reffsdp"))
    if name == "torch":
        from .torch_fsdp import torch_implementation

        return torch_implementation()
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - any failure to import is the user's to see
        raise ImplementationError(
            f"cannot import the implementation {name!r}: {type(error).__name__}: {error}; "
            "give reffsdp, torch or the dotted path of an importable module (its folder "
            "on PYTHONPATH, or the current directory)"
        ) from error
    return from_module(name, module, _module_version(module))


def resolve(impl: Implementation | str) -> Implementation:
    """``impl`` itself, or the implementation it names."""
    return impl if isinstance(impl, Implementation) else load_implementation(impl)


def from_module(name: str, module: ModuleType, version: str, **adapters: Any) -> Implementation:
    """``module`` as an implementation called ``name``: the APIs it has, the ones it lacks
    with the names missing; ``adapters`` set the other fields of :class:`Implementation`."""
    missing = []
    for api, names in NAMES_OF_API.items():
        absent = [each for each in names if not hasattr(module, each)]
        if absent:
            missing.append((api, f"{name} does not export {', '.join(absent)}"))
    if len(missing) == len(NAMES_OF_API):
        raise ImplementationError(
            f"{name} ({getattr(module, '__file__', module)}) exports neither FSDP API: the "
            f"per-parameter API needs {', '.join(FULLY_SHARD_NAMES)}, the wrapper API "
            f"{', '.join(WRAPPER_NAMES)} (the names of torch.distributed.fsdp)"
        )
    fully_shard = getattr(module, "fully_shard", None)
    adapters.setdefault("size_handshakes", _is_reffsdps(fully_shard))
    adapters.setdefault("through_reffsdp_seam", name == DEFAULT)
    return Implementation(name, version, module, tuple(missing), **adapters)


def _is_reffsdps(function: Any) -> bool:
    """Whether ``function`` is reffsdp's ``fully_shard`` (perhaps wrapped by a fork)."""
    if function is None:
        return False
    unwrapped = inspect.unwrap(function)
    return getattr(unwrapped, "__module__", "").split(".")[0] == "reffsdp"


def _module_version(module: ModuleType) -> str:
    """``__version__`` of ``module`` or of its top-level package, else its distribution's."""
    top = module.__name__.split(".")[0]
    for candidate in (module, importlib.import_module(top)):
        version = getattr(candidate, "__version__", None)
        if version is not None:
            return str(version)
    return _distribution_version(top)


def _distribution_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


__all__ = [
    "DEFAULT",
    "FULLY_SHARD_NAMES",
    "WRAPPER_NAMES",
    "Implementation",
    "ImplementationError",
    "from_module",
    "load_implementation",
    "resolve",
]
