"""torch's older optimizer-state calls on the wrapper API, built on the newer calls' core.

[Note: the older optimizer-state calls]
torch deprecates these in favour of ``optim_state_dict`` and ``optim_state_dict_to_load``
under ``state_dict_type``. Each is one direction of the core (``optim_state.py`` saves,
``optim_state_load.py`` loads) with its settings fixed by the call instead:

================================  =========  ==============================================
call                              direction  settings
================================  =========  ==============================================
full_optim_state_dict             save       whole tensors on CPU; ``rank0_only`` (default
                                             True): other ranks return ``{}``
sharded_optim_state_dict          save       tensors chunked on dim 0, on CPU
shard_full_optim_state_dict       load       a full dict every rank holds; no collective
scatter_full_optim_state_dict     load       rank 0's full dict, sent over ``group``
flatten_sharded_optim_state_dict  load       a sharded dict, gathered whole
rekey_optim_state_dict            neither    parameter ids to names or back; no collective
================================  =========  ==============================================

All but the last warn (``FutureWarning``) that they are being deprecated. Parameter ids
follow ``optim``'s parameter order; they follow ``optim_input`` (what was passed to the
optimizer: its parameters, or its parameter groups) when that is given (a
``FutureWarning`` too: the argument is deprecated), and ``model.parameters()`` when
neither is given.
"""

from __future__ import annotations

import copy
import enum
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import state_dict as sd
from .optim_state import (
    PARAM_GROUPS,
    PARAMS,
    STATE,
    Key,
    SaveOptions,
    check_model_and_optim,
    is_named,
    optimizer_ids,
    optimizer_names,
    owners,
    save_optim_state,
)
from .optim_state_load import load_optim_state

OptimInput = Iterable[nn.Parameter] | Iterable[dict[str, Any]] | None


class OptimStateKeyType(enum.Enum):
    """How optimizer state dicts key their per-parameter state."""

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


OptimStateKeyType.__module__ = "reffsdp.fully_sharded_data_parallel"  # where users import it


# -- saving ---------------------------------------------------------------------------------


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: OptimInput = None,
    rank0_only: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    check_model_and_optim("full_optim_state_dict", model, optim)
    _warn_deprecated("full_optim_state_dict", "optim_state_dict")
    _warn_optim_input(optim_input)
    raw = optim.state_dict()
    keys = _saving_keys(model, optim, raw, optim_input)
    options = SaveOptions(full=True, rank0_only=rank0_only)
    return save_optim_state(model, raw, keys, options, group)


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    check_model_and_optim("sharded_optim_state_dict", model, optim)
    _warn_deprecated("sharded_optim_state_dict", "optim_state_dict")
    config = sd.get_state_dict_type(model).optim_state_dict_config
    options = SaveOptions(full=False, use_dtensor=getattr(config, "_use_dtensor", False))
    raw = optim.state_dict()
    return save_optim_state(model, raw, _saving_keys(model, optim, raw, None), options, group)


def _saving_keys(
    model: nn.Module, optim: torch.optim.Optimizer, raw: dict[str, Any], optim_input: OptimInput
) -> dict[Key, nn.Parameter]:
    if optim_input is not None:
        return _ids_from_optim_input(model, optim_input)
    return optimizer_names(model, optim) if is_named(raw) else optimizer_ids(optim)


# -- loading --------------------------------------------------------------------------------


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    _warn_deprecated("shard_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    keys = _loading_keys(model, optim_input, optim)
    return load_optim_state(model, full_optim_state_dict, keys, rank0_only=False, group=None)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any | None = None,
) -> dict[str, Any]:
    _warn_deprecated("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    _warn_optim_input(optim_input)
    keys = _loading_keys(model, optim_input, optim)
    return load_optim_state(model, full_optim_state_dict, keys, rank0_only=True, group=group)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    _warn_deprecated("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    keys = _loading_keys(model, None, optim)
    return load_optim_state(model, sharded_optim_state_dict, keys, rank0_only=False, group=None)


def _loading_keys(
    model: nn.Module, optim_input: OptimInput, optim: torch.optim.Optimizer | None
) -> dict[nn.Parameter, Key]:
    ids = _ids(model, optim_input, optim)
    return {param: key for key, param in ids.items()}


# -- rekeying -------------------------------------------------------------------------------


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Key ``optim_state_dict``'s parameters by name or by id (as ``optim``, or
    ``optim_input``, numbers them): between a wrapped model's full optimizer state dict
    and a plain model's optimizer. Returns the dict itself when it is keyed so already."""
    _warn_optim_input(optim_input)
    if not isinstance(optim_state_key_type, OptimStateKeyType):
        raise AssertionError(
            "optim_state_key_type must be reffsdp's OptimStateKeyType.PARAM_NAME or "
            f"PARAM_ID, got {optim_state_key_type!r}"
        )
    to_names = optim_state_key_type is OptimStateKeyType.PARAM_NAME
    key_types = {type(key) for key in optim_state_dict[STATE]}
    if len(key_types) > 1 or not key_types <= {int, str}:
        raise ValueError(
            "an optimizer state dict must key its state by parameter ids (int) or by names "
            f"(str), not both: got keys {list(optim_state_dict[STATE])}"
        )
    if key_types <= ({str} if to_names else {int}):
        return optim_state_dict
    names = _single_names(model)
    name_of_id = {key: names[param] for key, param in _ids(model, optim_input, optim).items()}
    new_key = name_of_id if to_names else {name: key for key, name in name_of_id.items()}
    groups = copy.deepcopy(optim_state_dict[PARAM_GROUPS])
    for group in groups:
        group[PARAMS] = sorted(new_key[key] for key in group[PARAMS])
    state = {new_key[key]: value for key, value in optim_state_dict[STATE].items()}
    return {STATE: state, PARAM_GROUPS: groups}


def _single_names(model: nn.Module) -> dict[nn.Parameter, str]:
    names = {}
    for param, owner in owners(model).items():
        if len(owner.fqns) != 1:
            raise RuntimeError(
                f"rekey_optim_state_dict needs one name per parameter, but a FlatParameter "
                f"stands for {list(owner.fqns)}: rekey against the unwrapped model (or one "
                "wrapped with use_orig_params=True)"
            )
        names[param] = owner.fqns[0]
    return names


# -- parameter ids --------------------------------------------------------------------------


def _ids(
    model: nn.Module, optim_input: OptimInput, optim: torch.optim.Optimizer | None
) -> dict[Key, nn.Parameter]:
    """Id to parameter: ``optim``'s order unless ``optim_input`` is given or neither is."""
    if optim_input is None and optim is not None:
        return optimizer_ids(optim)
    return _ids_from_optim_input(model, optim_input)


def _ids_from_optim_input(model: nn.Module, optim_input: OptimInput) -> dict[Key, nn.Parameter]:
    """Id to parameter as an optimizer built from ``optim_input`` numbers them
    (``model.parameters()`` when ``None``)."""
    if optim_input is None:
        return dict(enumerate(model.parameters()))
    try:
        entries = list(optim_input)
    except TypeError as error:
        raise TypeError(
            f"optim_input must list parameters or parameter groups, got {optim_input!r}"
        ) from error
    if not entries:
        raise ValueError("optim_input is empty: it must list the optimizer's parameters")
    if all(isinstance(entry, torch.Tensor) for entry in entries):
        return dict(enumerate(entries))
    if all(isinstance(entry, dict) for entry in entries):
        return dict(enumerate(param for group in entries for param in group[PARAMS]))
    raise TypeError(
        "optim_input must list parameters (tensors) or parameter groups (dicts), not a mix "
        f"of {sorted({type(entry).__name__ for entry in entries})}"
    )


# -- warnings -------------------------------------------------------------------------------


def _warn_deprecated(name: str, replacement: str) -> None:
    warnings.warn(
        f"FullyShardedDataParallel.{name} is being deprecated: use "
        f"FullyShardedDataParallel.{replacement} instead, with "
        "FullyShardedDataParallel.state_dict_type choosing full or sharded state",
        FutureWarning,
        stacklevel=4,  # the caller of FullyShardedDataParallel.<name>
    )


def _warn_optim_input(optim_input: OptimInput) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated: pass `optim` (or nothing, for an "
            "optimizer built from model.parameters()) instead",
            FutureWarning,
            stacklevel=4,
        )
