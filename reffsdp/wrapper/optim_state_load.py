"""Optimizer state dicts of the wrapper API: loading one keyed by original names.

See [Note: optimizer state of flat parameters] and [Note: one order for every rank's
collectives] in ``optim_state.py``: loading walks the model's parameters, gathers sharded
values whole (collective, hence in model order), and keeps this rank's shard of each.

[Note: one flat parameter's state from its originals' states]
A flat parameter has one optimizer state for all the originals flattened into it, so
loading merges theirs, as torch's wrapper does:

1. a tensor of 1+ dims must have its parameter's shape (else a ``ValueError`` naming the
   parameter and both shapes: the state dict was saved for a model of another shape); an
   original without it contributes zeros;
2. a 0-dim tensor or other value (Adam's ``step``) must be present for every original and
   the same for all (else a ``ValueError``): it is one value for the flat parameter;
3. originals that have state must name the same states.

Original parameters (``use_orig_params=True``) keep their own state; rule 1 applies to
them too. Loaded state is keyed by the target optimizer's ids (or names, for a named
optimizer), so ranks whose optimizers order parameters differently each get their own keys.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import StateDictType
from ..core import comms
from . import state_dict as sd
from .optim_state import (
    PARAM_GROUPS,
    PARAMS,
    STATE,
    Key,
    Owner,
    check_model_and_optim,
    copy_value,
    is_shardable,
    optimizer_ids,
    optimizer_names,
    owners,
)


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Turn a state dict from ``optim_state_dict`` into one ``optim.load_state_dict``
    takes: keyed by parameter ids (names for a named optimizer), this rank's shard of
    every state tensor."""
    check_model_and_optim("optim_state_dict_to_load", model, optim)
    settings = sd.get_state_dict_type(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    rank0_only = full and getattr(settings.optim_state_dict_config, "rank0_only", False)
    keys = optimizer_names(model, optim) if is_named_optimizer else optimizer_ids(optim)
    result = load_optim_state(
        model,
        optim_state_dict,
        {param: key for key, param in keys.items()},
        rank0_only=rank0_only,
        group=group,
        named_optim=optim if is_named_optimizer else None,
    )
    if load_directly:
        optim.load_state_dict(result)
    return result


def load_optim_state(
    model: nn.Module,
    optim_state_dict: dict[str, Any] | None,
    keys: dict[nn.Parameter, Key],
    *,
    rank0_only: bool,
    group: dist.ProcessGroup | None,
    named_optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """``optim_state_dict`` (keyed by original names; with ``rank0_only`` rank 0's, sent
    to all) keyed by ``keys``, with this rank's shard of every state tensor."""
    if rank0_only:
        optim_state_dict = _from_rank0(optim_state_dict, group)
    if not isinstance(optim_state_dict, dict) or STATE not in optim_state_dict:
        found = list(optim_state_dict) if isinstance(optim_state_dict, dict) else None
        raise ValueError(
            f"an optimizer state dict needs a {STATE!r} entry, got keys {found}: pass what "
            "optim_state_dict() (or full_optim_state_dict()) returned"
        )
    saved = optim_state_dict[STATE]
    all_owners = owners(model)
    state: dict[Any, Any] = {}
    claimed: set[str] = set()
    for param, owner in all_owners.items():  # model order: collectives match across ranks
        if not any(fqn in saved for fqn in owner.fqns):
            continue
        claimed.update(owner.fqns)
        local = _local_state(owner, saved)
        if param not in keys:  # not a parameter of this optimizer
            continue
        if not local and named_optim is not None and owner.index is not None:
            local = copy.deepcopy(named_optim.state.get(param, {}))
        if local:
            state[keys[param]] = local
    # State under names no parameter has (the optimizer's own): kept as it is.
    state.update({k: copy.copy(v) for k, v in saved.items() if k not in claimed})
    result: dict[str, Any] = {STATE: state}
    if PARAM_GROUPS in optim_state_dict:
        groups = optim_state_dict[PARAM_GROUPS]
        result[PARAM_GROUPS] = _keyed_param_groups(groups, all_owners, keys)
    return result


def _from_rank0(optim_state_dict: Any, group: dist.ProcessGroup | None) -> Any:
    holder = [optim_state_dict if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    comms.broadcast_object_list(holder, src, group)
    return holder[0]


def _keyed_param_groups(
    groups: list[dict[str, Any]],
    all_owners: dict[nn.Parameter, Owner],
    keys: dict[nn.Parameter, Key],
) -> list[dict[str, Any]]:
    """The saved groups' settings, each group listing the keys of its parameters, sorted."""
    key_of = {fqn: keys[p] for p, owner in all_owners.items() if p in keys for fqn in owner.fqns}
    keyed = []
    for group in groups:
        unknown = [name for name in group[PARAMS] if name not in key_of]
        if unknown:
            raise KeyError(
                f"the optimizer state dict's parameter groups list {unknown}, which are not "
                "parameters of the optimizer to load into"
            )
        settings = {k: copy.deepcopy(v) for k, v in group.items() if k != PARAMS}
        keyed.append({**settings, PARAMS: sorted({key_of[name] for name in group[PARAMS]})})
    return keyed


# -- one optimizer parameter's state --------------------------------------------------------


def _local_state(owner: Owner, saved: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """This rank's state for one optimizer parameter, from per-name (maybe sharded) states."""
    instance = owner.instance
    if instance is None:
        return {k: copy_value(v) for k, v in saved.get(owner.fqns[0], {}).items()}

    def whole(values: dict[str, Any]) -> dict[str, Any]:  # collective for sharded values
        return {
            name: sd.full_tensor(v, instance) if isinstance(v, torch.Tensor) else v
            for name, v in values.items()
        }

    states = [whole(saved[fqn]) if saved.get(fqn) else None for fqn in owner.fqns]
    if owner.index is not None:
        return _orig_param_piece(owner, states[0] or {})
    return _flat_param_shard(owner, states)


def _orig_param_piece(owner: Owner, values: dict[str, Any]) -> dict[str, Any]:
    """``use_orig_params=True``: this rank's piece of one original parameter's state (none
    where the rank holds none of the parameter, as the optimizer would have)."""
    instance, index = owner.instance, owner.index
    assert instance is not None and index is not None and instance.handle is not None
    handle = instance.handle
    for name, value in values.items():
        if is_shardable(value):
            _check_shape(owner.fqns[0], name, value, handle.layout.shapes[index])
    piece = handle.rank_shard.params[index]
    if not piece.in_shard:
        return {}
    out = {}
    for name, value in values.items():
        if is_shardable(value):
            value = value.reshape(-1)[piece.intra_param_start : piece.intra_param_end]
            value = value.clone().view(handle.orig_params[index].shape)
        out[name] = copy_value(value)
    return out


def _flat_param_shard(owner: Owner, states: list[dict[str, Any] | None]) -> dict[str, Any]:
    """This rank's shard of one flat parameter's state, merged from its originals' states
    (see [Note: one flat parameter's state from its originals' states])."""
    present = [(fqn, s) for fqn, s in zip(owner.fqns, states) if s is not None]
    if not present:
        return {}
    names = list(present[0][1])
    for fqn, values in present:
        if set(values) != set(names):  # rule 3
            raise ValueError(
                f"Differing optimizer state names for the unflattened parameters: "
                f"{list(owner.fqns)}: the parameters flattened into one FlatParameter must "
                f"have the same state names, but {present[0][0]!r} has {sorted(names)} and "
                f"{fqn!r} has {sorted(values)}"
            )
    out = {}
    for name in names:
        values = [s.get(name) if s is not None else None for s in states]
        kinds = {_kind(v) for v in values if v is not None}
        if not kinds:
            out[name] = None
        elif len(kinds) > 1:
            raise ValueError(
                f"Differing optimizer state types for state {name!r} of the parameters "
                f"{list(owner.fqns)}, flattened into one FlatParameter: {sorted(kinds)}"
            )
        elif kinds == {"tensor"}:
            out[name] = _flat_tensor_shard(owner, name, values)
        else:
            out[name] = _shared_value(owner, name, values)
    return out


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor" if value.dim() > 0 else "0-dim tensor"
    return type(value).__name__


def _flat_tensor_shard(owner: Owner, name: str, values: list[Any]) -> torch.Tensor:
    """Rule 1: the originals' tensors (zeros where missing) laid out as the flat parameter
    is, and this rank's shard of that."""
    instance = owner.instance
    assert instance is not None and instance.handle is not None
    layout, shard = instance.handle.layout, instance.handle.rank_shard
    dtypes = sorted({str(v.dtype) for v in values if v is not None})
    if len(dtypes) > 1:
        raise ValueError(
            "All unflattened parameters comprising a single flat parameter must have "
            f"positive-dimension tensor state with the same dtype but got dtypes {dtypes} "
            f"for state {name!r} of the parameters {list(owner.fqns)}"
        )
    dtype = next(v.dtype for v in values if v is not None)
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=instance.device)
    for i, (fqn, value) in enumerate(zip(owner.fqns, values)):
        if value is None:
            continue
        _check_shape(fqn, name, value, layout.shapes[i])
        flat.narrow(0, layout.param_offsets[i], layout.numels[i]).copy_(value.reshape(-1))
    return flat.narrow(0, shard.flat_start, shard.shard_numel).clone()


def _shared_value(owner: Owner, name: str, values: list[Any]) -> Any:
    """Rule 2: one 0-dim tensor or other value, the same for every original."""
    first = next(v for v in values if v is not None)
    if not all(v is not None and _same(v, first) for v in values):
        shown = [v.item() if isinstance(v, torch.Tensor) else v for v in values]
        raise ValueError(
            "All unflattened parameters comprising a single flat parameter must have scalar "
            f"state with the same value and dtype but got values {shown} (None: no state) "
            f"for state {name!r} of the parameters {list(owner.fqns)}, flattened into one "
            "FlatParameter: give every one of them the same value"
        )
    return copy_value(first)


def _same(value: Any, other: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == other.dtype and torch.equal(value.cpu(), other.cpu())
    return bool(value == other)


def _check_shape(fqn: str, name: str, value: torch.Tensor, shape: torch.Size) -> None:
    """Rule 1's shape check."""
    if value.shape != shape:
        raise ValueError(
            f"optimizer state {name!r} of parameter {fqn!r} has shape {tuple(value.shape)}, "
            f"but the parameter has shape {tuple(shape)}: the optimizer state dict was saved "
            "for a model of another shape"
        )
