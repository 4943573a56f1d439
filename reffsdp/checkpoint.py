"""``torch.distributed.checkpoint.state_dict``'s functions, for models of either API.

DCP's ``get_state_dict``/``set_state_dict`` and their model and optimizer halves recognise
torch's ``FullyShardedDataParallel``, not this package's. Each function here is DCP's own,
called with this package's stand-ins in place for the length of the call (see [Note: DCP's
state-dict functions and this wrapper] in ``wrapper/dcp_support.py``): a model of
``reffsdp.FullyShardedDataParallel`` saves and loads as torch's wrapper does, and any other
model (``fully_shard``, torch's wrapper, none) as with DCP's functions. Same arguments,
same results::

    from reffsdp.checkpoint import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optim)

Code that calls DCP's functions itself (a training library's checkpointer, say) runs inside
:func:`recognize_wrappers` instead. Outside both, DCP's module is as torch left it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .core import torch_internals
from .wrapper.dcp_support import stand_ins

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "recognize_wrappers",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


def recognize_wrappers() -> contextlib.AbstractContextManager[None]:
    """A context inside which DCP's state-dict functions, called by anyone, recognise this
    package's ``FullyShardedDataParallel``; DCP's module is restored on leaving."""
    return stand_ins()


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """DCP's ``get_model_state_dict``, recognising this package's wrapper."""
    with stand_ins():
        return _dcp().get_model_state_dict(model, submodules=submodules, options=options)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """DCP's ``get_optimizer_state_dict``, recognising this package's wrapper."""
    with stand_ins():
        return _dcp().get_optimizer_state_dict(
            model, optimizers, submodules=submodules, options=options
        )


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's ``get_state_dict`` (model, optimizer), recognising this package's wrapper."""
    with stand_ins():
        return _dcp().get_state_dict(model, optimizers, submodules=submodules, options=options)


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> Any:
    """DCP's ``set_model_state_dict``, recognising this package's wrapper."""
    with stand_ins():
        return _dcp().set_model_state_dict(model, model_state_dict, options=options)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """DCP's ``set_optimizer_state_dict``, recognising this package's wrapper."""
    with stand_ins():
        _dcp().set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> Any:
    """DCP's ``set_state_dict``, recognising this package's wrapper."""
    with stand_ins():
        return _dcp().set_state_dict(
            model,
            optimizers,
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=options,
        )


def _dcp() -> Any:
    return torch_internals.dcp_state_dict_module()
