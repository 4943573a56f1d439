"""Optimizer state dicts of the wrapper API, keyed by the original parameters' names.

[Note: optimizer state of flat parameters]
The optimizer steps what the wrapper gives it: with ``use_orig_params=False`` one
:class:`~reffsdp.wrapper.flat_param.FlatParameter` per instance, whose state tensors are
flat shards like it (``shard_numel`` elements); with ``use_orig_params=True`` each original
parameter's 1-D piece of the shard, whose state tensors are pieces too (a rank holding none
of a parameter gives it no gradient, so optimizers keep no state for it there). Either way
one instance's state for one state name (``exp_avg``, say) fills that rank's shard of
a flat buffer laid out like the flat parameter. So:

* saving (:func:`optim_state_dict`) writes each rank's pieces into a flat shard, all-gathers
  the flat buffer over the shard group and cuts every original parameter out of it, whole;
  ``FULL_STATE_DICT`` keeps the whole tensors, the other types chunk them on dim 0 like the
  model's sharded state dict (``ShardedTensor``, or ``DTensor`` with ``_use_dtensor``);
* loading (:func:`optim_state_dict_to_load`) gathers sharded values whole, lays every
  parameter's state into a flat buffer and keeps this rank's shard of it (or, with
  ``use_orig_params=True``, this rank's piece of each parameter).

Whole tensors in between make the result independent of the world size that saved it: a
full optimizer state dict saved by 4 ranks loads on 2. Non-tensor and 0-dim state (Adam's
``step``) is per parameter; a flat parameter's is shared by all its originals. Parameters
no instance manages (ignored ones) keep their state as it is, under their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import ShardingStrategy, StateDictType
from ..core import comms
from . import state_dict as sd

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

STATE, PARAM_GROUPS, PARAMS = "state", "param_groups", "params"


@dataclass(frozen=True)
class _Owner:
    """Which original parameters one optimizer parameter stands for."""

    fqns: tuple[str, ...]  # original names, relative to the model
    instance: FullyShardedDataParallel | None  # None: a parameter no instance manages
    index: int | None  # use_orig_params=True: the original's index in the flat parameter


def _owners(model: nn.Module) -> dict[nn.Parameter, _Owner]:
    """Every parameter an optimizer of ``model`` may hold, in the same order on every rank."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    owners: dict[nn.Parameter, _Owner] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FullyShardedDataParallel) or module._handle is None:
            continue
        module._lazy_init()
        prefix = sd.clean_name(f"{name}.") if name else ""
        handle = module._handle
        fqns = tuple(prefix + fqn for fqn in handle.fqns)
        if handle.use_orig_params:
            for index, param in enumerate(handle.orig_params):
                owners[param] = _Owner((fqns[index],), module, index)
        else:
            owners[handle.flat_param] = _Owner(fqns, module, None)
    for name, param in model.named_parameters():
        owners.setdefault(param, _Owner((sd.clean_name(name),), None, None))
    return owners


def _optim_params(optim: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
    return [list(group[PARAMS]) for group in optim.param_groups]


def _settings(model: nn.Module) -> tuple[bool, Any]:
    """(whether the optimizer state dict is full, the optimizer config in force)."""
    settings = sd.get_state_dict_type(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    return full, settings.optim_state_dict_config


# -- saving -----------------------------------------------------------------------------------


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim``'s state keyed by original names, full or sharded per the type in force."""
    full, config = _settings(model)
    raw = optim_state_dict if optim_state_dict is not None else optim.state_dict()
    params = [p for group_params in _optim_params(optim) for p in group_params]
    by_param = {params[pid]: state for pid, state in raw[STATE].items()}
    owners = _owners(model)
    rank0_only = full and getattr(config, "rank0_only", False)
    offload = getattr(config, "offload_to_cpu", True)
    use_dtensor = getattr(config, "_use_dtensor", False)

    state: dict[str, dict[str, Any]] = {}
    for param in params:
        owner = owners.get(param)
        if owner is None:
            raise ValueError("the optimizer holds a parameter that is not one of the model's")
        for fqn, values in _whole_states(owner, param, by_param).items():
            out = {}
            for name, value in values.items():
                instance = owner.instance
                if not full and _is_shardable(value) and _is_sharded(instance):
                    dtensor = use_dtensor or instance._device_mesh is not None
                    value = sd.chunk_sharded(value, instance, dtensor)
                if offload and isinstance(value, torch.Tensor):
                    value = value.cpu()
                out[name] = value
            state[fqn] = out
    if any(owner.index is not None for owner in owners.values()):
        state = {fqn: state[fqn] for fqn in sorted(state)}  # torch's order with orig params
    if rank0_only and dist.get_rank(group) != 0:
        return {}
    groups = []
    for raw_group, group_params in zip(raw[PARAM_GROUPS], _optim_params(optim)):
        names = [fqn for p in group_params for fqn in owners[p].fqns]
        groups.append({**{k: v for k, v in raw_group.items() if k != PARAMS}, PARAMS: names})
    return {STATE: state, PARAM_GROUPS: groups}


def _is_sharded(instance: FullyShardedDataParallel | None) -> bool:
    """Whether sharded optimizer state dicts chunk this instance's state (NO_SHARD: whole)."""
    return instance is not None and instance.sharding_strategy is not ShardingStrategy.NO_SHARD


def _is_shardable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _whole_states(
    owner: _Owner, param: nn.Parameter, by_param: dict[nn.Parameter, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per original name, its state with whole tensors (collective for managed parameters)."""
    if owner.instance is None:
        local = by_param.get(param, {})
        return {owner.fqns[0]: {k: _copy(v) for k, v in local.items()}} if local else {}
    instance = owner.instance
    handle = instance._handle
    assert handle is not None
    layout = handle.layout
    if owner.index is None:  # a flat parameter: its state tensors are flat shards
        local = by_param.get(param, {})
        result: dict[str, dict[str, Any]] = {fqn: {} for fqn in owner.fqns} if local else {}
        # Tensors cut into the originals first, then what they share (``step``), as torch's.
        names = sorted(local, key=lambda name: not _is_shardable(local[name]))
        for name in names:
            value = local[name]
            flat = _gather_flat(value, instance) if _is_shardable(value) else None
            for i, fqn in enumerate(owner.fqns):
                if flat is None:
                    result[fqn][name] = _copy(value)
                else:
                    piece = flat.narrow(0, layout.param_offsets[i], layout.numels[i])
                    result[fqn][name] = piece.view(layout.shapes[i]).clone()
        return result
    return _whole_orig_state(owner, param, by_param)


def _whole_orig_state(
    owner: _Owner, param: nn.Parameter, by_param: dict[nn.Parameter, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """One original parameter's state (``use_orig_params=True``), gathered from its pieces.

    Ranks may hold no piece of it (and so, for some optimizers, no state): which state
    names exist, with which dtype, and the non-tensor values are agreed on first.
    """
    instance, index = owner.instance, owner.index
    assert instance is not None and index is not None
    handle = instance._handle
    assert handle is not None
    local = by_param.get(param, {})
    summary = {
        name: (value.dtype, None) if _is_shardable(value) else (None, value)
        for name, value in local.items()
    }
    summaries: list[Any] = [None] * instance.world_size
    if instance.world_size > 1:
        comms.all_gather_object(summaries, summary, instance._mesh_info.shard_group)
    else:
        summaries = [summary]
    merged: dict[str, tuple[torch.dtype | None, Any]] = {}
    for each in summaries:
        for name, entry in each.items():
            merged.setdefault(name, entry)
    if not merged:
        return {}
    piece = handle.rank_shard.params[index]
    layout = handle.layout
    out: dict[str, Any] = {}
    for name, (dtype, value) in merged.items():
        if dtype is None:
            out[name] = _copy(local.get(name, value))
            continue
        shard = torch.zeros(layout.shard_numel, dtype=dtype, device=instance.compute_device)
        if name in local and piece.in_shard and piece.numel_in_shard:
            shard.narrow(0, piece.offset_in_shard, piece.numel_in_shard).copy_(
                local[name].reshape(-1)
            )
        flat = _gather_flat(shard, instance)
        whole = flat.narrow(0, layout.param_offsets[index], layout.numels[index])
        out[name] = whole.view(layout.shapes[index]).clone()
    return {owner.fqns[0]: out}


def _copy(value: Any) -> Any:
    """A tensor the optimizer does not own (its ``step`` is updated in place), else as is."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _gather_flat(shard: torch.Tensor, instance: FullyShardedDataParallel) -> torch.Tensor:
    """All-gather a flat shard (``shard_numel`` elements) over the instance's shard group."""
    handle = instance._handle
    assert handle is not None
    if shard.numel() != handle.layout.shard_numel:
        raise ValueError(
            f"optimizer state of {shard.numel()} elements for a flat parameter shard of "
            f"{handle.layout.shard_numel}: the optimizer state does not belong to this model"
        )
    shard = shard.reshape(-1).to(instance.compute_device)
    if instance.world_size == 1:
        return shard
    output = shard.new_empty(handle.layout.padded_numel)
    comms.all_gather(output, shard.contiguous(), instance._mesh_info.shard_group)
    return output


# -- loading ----------------------------------------------------------------------------------


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Turn a state dict from :func:`optim_state_dict` into one ``optim.load_state_dict``
    takes: keyed by parameter ids, this rank's shard of every state tensor."""
    if is_named_optimizer:
        raise NotImplementedError(
            "optim_state_dict_to_load(is_named_optimizer=True) is not supported; load into a "
            "torch.optim.Optimizer"
        )
    full, config = _settings(model)
    if full and getattr(config, "rank0_only", False):
        holder = [optim_state_dict if dist.get_rank(group) == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        comms.broadcast_object_list(holder, src, group)
        optim_state_dict = holder[0]
    owners = _owners(model)
    loaded_groups = optim_state_dict[PARAM_GROUPS]
    param_groups = _optim_params(optim)
    if len(loaded_groups) != len(param_groups):
        raise ValueError(
            f"the optimizer state dict has {len(loaded_groups)} parameter groups, the "
            f"optimizer {len(param_groups)}"
        )
    state: dict[int, dict[str, Any]] = {}
    groups = []
    pid = 0
    for loaded, group_params in zip(loaded_groups, param_groups):
        expected = [fqn for p in group_params for fqn in owners[p].fqns]
        if sorted(loaded[PARAMS]) != sorted(expected):
            missing = sorted(set(expected) - set(loaded[PARAMS]))
            unexpected = sorted(set(loaded[PARAMS]) - set(expected))
            raise ValueError(
                "the optimizer state dict's parameter group does not match the optimizer's: "
                f"missing {missing}, unexpected {unexpected}"
            )
        ids = []
        for param in group_params:
            local = _local_state(owners[param], optim_state_dict[STATE])
            if local:
                state[pid] = local
            ids.append(pid)
            pid += 1
        groups.append({**{k: v for k, v in loaded.items() if k != PARAMS}, PARAMS: ids})
    result = {STATE: state, PARAM_GROUPS: groups}
    if load_directly:
        optim.load_state_dict(result)
    return result


def _local_state(owner: _Owner, saved: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """This rank's state for one optimizer parameter, from per-name (maybe sharded) states."""
    instance = owner.instance
    if instance is None:
        return {k: _copy(v) for k, v in saved.get(owner.fqns[0], {}).items()}
    handle = instance._handle
    assert handle is not None
    layout, shard = handle.layout, handle.rank_shard

    def whole(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _copy(sd.full_tensor(value, instance))
        return value

    if owner.index is not None:  # use_orig_params=True: this rank's piece of one parameter
        piece = shard.params[owner.index]
        out = {}
        if not piece.in_shard:  # as in torch: no state for a parameter this rank holds none of
            for value in saved.get(owner.fqns[0], {}).values():
                whole(value)  # gathering is collective: take part all the same
            return out
        for name, value in saved.get(owner.fqns[0], {}).items():
            value = whole(value)
            if _is_shardable(value):
                flat = value.reshape(-1)
                value = flat[piece.intra_param_start : piece.intra_param_end].clone()
                value = value.view(handle.orig_params[owner.index].shape)
            out[name] = value
        return out
    out: dict[str, Any] = {}
    flats: dict[str, torch.Tensor] = {}
    for i, fqn in enumerate(owner.fqns):
        for name, value in saved.get(fqn, {}).items():
            value = whole(value)
            if not _is_shardable(value):
                out.setdefault(name, value)
                continue
            if name not in flats:
                flats[name] = torch.zeros(
                    layout.padded_numel, dtype=value.dtype, device=instance.compute_device
                )
            start = layout.param_offsets[i]
            flats[name].narrow(0, start, layout.numels[i]).copy_(value.reshape(-1))
    for name, flat in flats.items():
        out[name] = flat.narrow(0, shard.flat_start, shard.shard_numel).clone()
    return out
