"""``torch.distributed.checkpoint.state_dict`` for the wrapper API.

[Note: DCP's state-dict functions and this wrapper]
``get_state_dict``/``set_state_dict`` (and the model and optimizer halves) recognise torch's
wrapper by looking up module-level names of ``torch.distributed.checkpoint.state_dict``:

* ``FSDP`` (torch's ``FullyShardedDataParallel``): ``isinstance`` checks when walking names
  (``_get_fqns``), ``FSDP.fsdp_modules(model)`` to decide whether the model is sharded,
  ``FSDP.state_dict_type`` around ``model.state_dict()``/``load_state_dict()``,
  ``FSDP.optim_state_dict`` and ``FSDP.optim_state_dict_to_load`` for the optimizer;
* ``_get_module_fsdp_state_if_fully_sharded_module``: a check that each such module has
  wrapper state.

A model of this package's wrappers passes none of them, and DCP then treats it as an
unsharded module: every rank saves its own shards of the optimizer state as if they were
whole. :func:`stand_ins` therefore replaces those two names, for as long as it is entered,
with stand-ins that send a model holding this package's wrappers to its own
``state_dict_type``, ``optim_state_dict`` and ``optim_state_dict_to_load`` (translating
torch's ``StateDictType`` and config objects into ours, field for field) and everything else
to the object DCP had. ``isinstance(x, stand_in)`` holds for instances of either class. A
model mixing both kinds of wrapper is refused with an error. ``reffsdp.checkpoint``'s
functions are DCP's, called inside :func:`stand_ins`.

Nothing is replaced outside such a call: building a wrapper leaves DCP's module alone. The
ranks of the threaded harness are threads of one process and may be inside at once, so the
names are replaced when the first enters and restored when the last leaves (a count under a
lock). Meanwhile every thread of the process sees the stand-ins, which act as torch's
objects for any model without this package's wrappers.

DCP's module is imported at the first call (it imports torch's FSDP package: DCP's own
dependency, never used here). Where it lacks the names (another torch release), entering
raises an error naming the wrapper's own state-dict calls to use instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn

from .. import api
from ..api import ShardingStrategy
from ..core import torch_internals
from . import state_dict
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .state import state_of

_lock = threading.Lock()
_entered = 0  # calls inside stand_ins() now, every thread together
_originals: tuple[Any, Any] = (None, None)  # DCP's own objects while ours stand in


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """Inside, DCP's state-dict functions recognise this package's wrapper (see [Note: DCP's
    state-dict functions and this wrapper])."""
    _enter()
    try:
        yield
    finally:
        _leave()


def _enter() -> None:
    global _entered, _originals
    with _lock:
        if _entered == 0:
            module = torch_internals.dcp_state_dict_module()
            wrapper, state_getter = torch_internals.dcp_wrapper_lookups(module)
            if not isinstance(wrapper, type) or not callable(state_getter):
                raise RuntimeError(
                    f"{module.__name__} has no {torch_internals.DCP_WRAPPER_LOOKUPS} to "
                    "extend in this torch release, so its get_state_dict/set_state_dict cannot "
                    "recognise reffsdp.FullyShardedDataParallel. Use "
                    "FullyShardedDataParallel.state_dict_type() with model.state_dict()/"
                    "load_state_dict() and FullyShardedDataParallel.optim_state_dict()/"
                    "optim_state_dict_to_load() instead"
                )
            torch_internals.set_dcp_wrapper_lookups(
                module, _stand_in(wrapper), _state_getter(state_getter)
            )
            _originals = (wrapper, state_getter)
        _entered += 1


def _leave() -> None:
    global _entered, _originals
    with _lock:
        _entered -= 1
        if _entered == 0:
            module = torch_internals.dcp_state_dict_module()
            torch_internals.set_dcp_wrapper_lookups(module, *_originals)
            _originals = (None, None)


# -- the stand-ins ----------------------------------------------------------------------------


class _StandInMeta(type):
    """``isinstance`` for either wrapper class; other class attributes from torch's."""

    original: type

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (cls.original, FullyShardedDataParallel))

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, (cls.original, FullyShardedDataParallel))

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls.original, name)


def _stand_in(original: type) -> type:
    """A class standing in for torch's wrapper class in DCP's module."""

    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
        wrapper_cls = FullyShardedDataParallel if _our_instances(module, original) else original
        return wrapper_cls.fsdp_modules(module, root_only)

    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: Any,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> Iterator[None]:
        if not _our_instances(module, original):
            with original.state_dict_type(
                module, state_dict_type, state_dict_config, optim_state_dict_config
            ):
                yield
            return
        with state_dict.state_dict_type(
            module,
            api.StateDictType[state_dict_type.name],
            _our_config(state_dict_config),
            _our_config(optim_state_dict_config),
            warn=False,
        ):
            yield

    def optim_state_dict(model, optim, optim_state_dict=None, group=None):
        ours = _our_instances(model, original)
        if not ours:
            return original.optim_state_dict(model, optim, optim_state_dict, group=group)
        return FullyShardedDataParallel.optim_state_dict(
            model, optim, optim_state_dict, group=_group(ours, group)
        )

    def optim_state_dict_to_load(
        model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False,
        group=None,
    ):  # fmt: skip
        ours = _our_instances(model, original)
        if not ours:
            return original.optim_state_dict_to_load(
                model, optim, optim_state_dict, is_named_optimizer, load_directly, group
            )
        return FullyShardedDataParallel.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, _group(ours, group)
        )

    namespace: dict[str, Any] = {
        "original": original,
        "__doc__": f"{original.__qualname__} or reffsdp's FullyShardedDataParallel",
        "fsdp_modules": staticmethod(fsdp_modules),
        "state_dict_type": staticmethod(state_dict_type),
        "optim_state_dict": staticmethod(optim_state_dict),
        "optim_state_dict_to_load": staticmethod(optim_state_dict_to_load),
    }
    return _StandInMeta(original.__name__, (), namespace)


def _state_getter(original: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
    """DCP's "wrapper state of this module" lookup: our instances are their own state,
    initialized first so that ``_is_root`` is known (DCP asks it for outermost ones first)."""

    def get_state(module: nn.Module) -> Any:
        state = state_of(module)
        if state is None:
            return original(module)
        state.lazy_init()
        return module

    return get_state


# -- helpers ----------------------------------------------------------------------------------


def _our_instances(module: nn.Module, original: type) -> list[FullyShardedDataParallel]:
    """This package's wrappers under ``module``; an error if torch's are there too."""
    ours = FullyShardedDataParallel.fsdp_modules(module)
    if ours and any(isinstance(m, original) for m in module.modules()):
        raise ValueError(
            f"{type(module).__name__} holds both torch's FullyShardedDataParallel and "
            "reffsdp's; torch.distributed.checkpoint.state_dict handles one kind per model"
        )
    return ours


def _our_config(config: Any) -> Any:
    """Torch's ``*StateDictConfig`` as ours (same class name and fields); ours as is."""
    if config is None or type(config).__module__ == api.__name__:
        return config
    ours = getattr(api, type(config).__name__, None)
    if ours is None or not dataclasses.is_dataclass(config):
        raise TypeError(f"no reffsdp counterpart of {type(config).__qualname__}")
    return ours(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def _group(instances: list[FullyShardedDataParallel], group: Any) -> Any:
    """DCP passes the root's group, or ``None`` for torch's hybrid strategies: the same for
    ours (the optimizer state dict's rank 0 is then the global rank 0, as in torch)."""
    if any(i.sharding_strategy in _HYBRID for i in instances):
        return None
    return group


_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
