"""Optimizer state dicts of the wrapper API, keyed by the original parameters' names: saving.

[Note: optimizer state of flat parameters]
The optimizer steps what the wrapper gives it: with ``use_orig_params=False`` one
:class:`~reffsdp.wrapper.flat_param.FlatParameter` per instance, whose state tensors are
flat shards like it (``shard_numel`` elements); with ``use_orig_params=True`` each original
parameter's 1-D piece of the shard, whose state tensors are pieces too (a rank holding none
of a parameter gives it no gradient, so optimizers keep no state for it there). Either way
one instance's state for one state name (``exp_avg``, say) fills that rank's shard of
a flat buffer laid out like the flat parameter. So:

* saving (:func:`save_optim_state`) writes each rank's pieces into a flat shard, all-gathers
  the flat buffer over the shard group and cuts every original parameter out of it, whole;
  a full state dict keeps the whole tensors, a sharded one chunks them on dim 0 like the
  model's sharded state dict (``ShardedTensor``, or ``DTensor`` with ``_use_dtensor``);
* loading (``optim_state_load.load_optim_state``) gathers sharded values whole, lays every
  parameter's state into a flat buffer and keeps this rank's shard of it (or, with
  ``use_orig_params=True``, this rank's piece of each parameter).

Whole tensors in between make the result independent of the world size that saved it: a
full optimizer state dict saved by 4 ranks loads on 2. Non-tensor and 0-dim state (Adam's
``step``) is per parameter; a flat parameter's is shared by all its originals. Parameters
no instance manages (ignored ones, or a root that is no instance) keep their state as it is,
under their names.

[Note: one order for every rank's collectives]
An optimizer state dict keys state by the optimizer's parameter ids (or, for a named
optimizer such as torch's ``_NamedOptimizer``, by parameter names), and ranks may list
their parameters to their optimizers in different orders. So no collective ever follows an
optimizer's order: both directions walk the model's parameters (:func:`owners`, the order
of ``model.named_parameters()``), the same on every rank. Saving first agrees on what to
save, with one ``all_gather_object`` of every rank's summary (which parameters have state,
under which state names, dtypes and scalar values):

1. flat parameters (``use_orig_params=False``): rank 0's optimizer decides, and every rank
   must hold state for each parameter rank 0 holds state for (else a ``RuntimeError`` on
   every rank, naming the ranks and parameters). The state dict lists parameters in rank 0's
   optimizer order, as torch's does;
2. original parameters (``use_orig_params=True``): any rank's state counts, since a rank
   holding no piece of a parameter has none. Its 0-dim and non-tensor values (``step``)
   come from the ranks holding a piece, as torch's wrapper takes them: a rank whose pieces
   are empty may keep stale ones (a named optimizer keeps its own state for such a
   parameter when loading). Names are listed as torch lists them: unmanaged parameters
   first, then each instance's, each run sorted by name.

Collectives then run per parameter in model order; which state names a parameter has comes
from the summaries, never from one rank's optimizer alone.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import ShardingStrategy, StateDictType
from ..core import comms
from . import state_dict as sd
from .state import WrapperState, state_of, states_under

STATE, PARAM_GROUPS, PARAMS = "state", "param_groups", "params"

Key = int | str  # an optimizer state dict's key for a parameter: its id, or its name
Names = tuple[str, ...]  # the original names one optimizer parameter stands for


class ModelOptimizerError(TypeError, AttributeError):
    """A ``model`` that is no module or an ``optim`` that is no optimizer (most often the two
    swapped): a ``TypeError``, and the ``AttributeError`` torch's wrapper fails with, asking
    the optimizer for its modules."""


def check_model_and_optim(call: str, model: Any, optim: Any) -> None:
    """``call(model, optim, ...)`` takes the wrapped model first and its optimizer second."""
    is_optimizer = hasattr(optim, PARAM_GROUPS) and hasattr(optim, "state_dict")
    if isinstance(model, nn.Module) and is_optimizer:
        return
    if isinstance(optim, nn.Module) and hasattr(model, PARAM_GROUPS):
        raise ModelOptimizerError(
            f"FullyShardedDataParallel.{call}(model, optim, ...) takes the model first and "
            f"the optimizer second, got a {type(model).__name__} and then a "
            f"{type(optim).__name__}: swap the two"
        )
    if not isinstance(model, nn.Module):
        raise ModelOptimizerError(
            f"FullyShardedDataParallel.{call}'s model must be the wrapped nn.Module, got a "
            f"{type(model).__name__}"
        )
    raise ModelOptimizerError(
        f"FullyShardedDataParallel.{call}'s optim must be the model's torch.optim.Optimizer, "
        f"got a {type(optim).__name__}"
    )


@dataclass(frozen=True)
class Owner:
    """Which original parameters one optimizer parameter stands for."""

    fqns: Names  # original names, relative to the model
    instance: WrapperState | None  # None: a parameter no instance manages
    index: int | None  # use_orig_params=True: the original's index in the flat parameter


def owners(model: nn.Module) -> dict[nn.Parameter, Owner]:
    """Every parameter an optimizer of ``model`` may hold, in the model's parameter order
    (the same on every rank; see [Note: one order for every rank's collectives])."""
    managed: dict[nn.Parameter, Owner] = {}
    for name, module in model.named_modules():
        instance = state_of(module)
        if instance is None or instance.handle is None:
            continue
        instance.lazy_init()
        prefix = sd.clean_name(f"{name}.") if name else ""
        handle = instance.handle
        fqns = tuple(prefix + fqn for fqn in handle.fqns)
        if handle.use_orig_params:
            for index, param in enumerate(handle.orig_params):
                managed[param] = Owner((fqns[index],), instance, index)
        else:
            managed[handle.flat_param] = Owner(fqns, instance, None)
    ordered: dict[nn.Parameter, Owner] = {}
    for name, param in model.named_parameters():
        ordered[param] = managed.pop(param, None) or Owner((sd.clean_name(name),), None, None)
    ordered.update(managed)  # managed but not registered on a module
    return ordered


def optimizer_ids(optim: torch.optim.Optimizer) -> dict[Key, nn.Parameter]:
    """Id to parameter, as ``optim.state_dict()`` numbers them: group by group, in order."""
    params = [param for group in optim.param_groups for param in group[PARAMS]]
    return dict(enumerate(params))


def optimizer_names(model: nn.Module, optim: torch.optim.Optimizer) -> dict[Key, nn.Parameter]:
    """Name to parameter for a named optimizer: the names ``model.named_parameters()``
    gives, in the optimizer's order."""
    names: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(param, name)
    params = [param for group in optim.param_groups for param in group[PARAMS]]
    missing = [i for i, param in enumerate(params) if param not in names]
    if missing:
        raise ValueError(f"the optimizer's parameters {missing} are not parameters of the model")
    return {names[param]: param for param in params}


def is_named(optim_state_dict: dict[str, Any]) -> bool:
    """Whether the state is keyed by parameter names (a named optimizer's), not ids."""
    state = optim_state_dict.get(STATE) or {}
    return isinstance(next(iter(state), None), str)


@dataclass(frozen=True)
class SaveOptions:
    """How :func:`save_optim_state` returns the state."""

    full: bool  # whole tensors; else chunked on dim 0 over each instance's shard group
    rank0_only: bool = False  # full only: ranks other than 0 return {}
    offload: bool = True  # tensors on CPU
    use_dtensor: bool = False  # sharded: DTensor, not ShardedTensor


# -- the newer call -----------------------------------------------------------------------


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim``'s state keyed by original names, full or sharded per the type in force."""
    check_model_and_optim("optim_state_dict", model, optim)
    settings = sd.get_state_dict_type(model)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    config = settings.optim_state_dict_config
    # A wrapper given a device mesh saves DTensors, as torch's sets ``_use_dtensor`` then.
    meshes = any(instance.device_mesh is not None for instance in states_under(model))
    options = SaveOptions(
        full=full,
        rank0_only=full and getattr(config, "rank0_only", False),
        offload=getattr(config, "offload_to_cpu", True),
        use_dtensor=getattr(config, "_use_dtensor", False) or meshes,
    )
    raw = optim_state_dict if optim_state_dict is not None else optim.state_dict()
    keys = optimizer_names(model, optim) if is_named(raw) else optimizer_ids(optim)
    return save_optim_state(model, raw, keys, options, group)


# -- saving ---------------------------------------------------------------------------------


def save_optim_state(
    model: nn.Module,
    raw: dict[str, Any],
    keys: dict[Key, nn.Parameter],
    options: SaveOptions,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """``raw`` (an optimizer state dict whose keys ``keys`` maps to parameters) keyed by
    original names, with whole or dim-0-chunked tensors (collective: every rank calls it)."""
    all_owners = owners(model)
    local = _local_states(raw[STATE], keys, all_owners)
    plan = _agree(all_owners, local, group)
    saved: dict[Names, dict[str, dict[str, Any]]] = {}
    for param, owner in all_owners.items():  # model order: collectives match across ranks
        if owner.fqns in plan.summaries and (owner.instance is not None or param in local):
            saved[owner.fqns] = _whole_states(owner, local.get(param, {}), plan, options)
    if options.rank0_only and dist.get_rank(group) != 0:
        return {}
    state = {fqn: values for names in plan.order for fqn, values in saved.get(names, {}).items()}
    state.update(_unknown_state(raw[STATE], keys))
    result: dict[str, Any] = {STATE: state}
    if PARAM_GROUPS in raw:
        result[PARAM_GROUPS] = _named_param_groups(raw[PARAM_GROUPS], keys, all_owners)
    return result


def _local_states(
    raw_state: dict[Key, dict[str, Any]],
    keys: dict[Key, nn.Parameter],
    all_owners: dict[nn.Parameter, Owner],
) -> dict[nn.Parameter, dict[str, Any]]:
    """This rank's state per parameter, in the optimizer's order."""
    local: dict[nn.Parameter, dict[str, Any]] = {}
    for key, param in keys.items():
        if key not in raw_state:
            continue
        if param not in all_owners:
            raise ValueError(
                f"the optimizer holds a parameter (key {key!r}) that is not one of the model's"
            )
        local[param] = raw_state[key]
    return local


def _unknown_state(raw_state: dict[Key, Any], keys: dict[Key, nn.Parameter]) -> dict[Key, Any]:
    """State under keys no parameter of the optimizer has: saved as it is, with a warning."""
    unknown = {key: value for key, value in raw_state.items() if key not in keys}
    for key in unknown:
        warnings.warn(
            f"optimizer state under key {key!r} belongs to no parameter of the optimizer "
            "(state of the optimizer's own, or of parameters it does not list?); it is "
            "saved unchanged",
            stacklevel=5,
        )
    return unknown


def _named_param_groups(
    groups: list[dict[str, Any]],
    keys: dict[Key, nn.Parameter],
    all_owners: dict[nn.Parameter, Owner],
) -> list[dict[str, Any]]:
    named = []
    for group in groups:
        names = [fqn for key in group[PARAMS] for fqn in all_owners[keys[key]].fqns]
        settings = {k: copy.deepcopy(v) for k, v in group.items() if k != PARAMS}
        named.append({**settings, PARAMS: names})
    return named


# -- agreeing on what to save ---------------------------------------------------------------

# Per state name: (dtype, numel) of a tensor of 1+ dims, else (None, the value).
Summary = dict[str, tuple[torch.dtype | None, Any]]


@dataclass
class _Plan:
    """What every rank saves, agreed before any tensor moves."""

    summaries: dict[Names, Summary]  # the parameters to save: their state names over ranks
    order: list[Names]  # the order of the saved state dict


def _summary(values: dict[str, Any]) -> Summary:
    def describe(value: Any) -> tuple[torch.dtype | None, Any]:
        if is_shardable(value):
            return value.dtype, value.numel()
        return None, value.detach().cpu() if isinstance(value, torch.Tensor) else value

    return {name: describe(value) for name, value in values.items()}


def _agree(
    all_owners: dict[nn.Parameter, Owner],
    local: dict[nn.Parameter, dict[str, Any]],
    group: dist.ProcessGroup | None,
) -> _Plan:
    """Rules 1 and 2 of [Note: one order for every rank's collectives]."""
    mine = [(all_owners[param].fqns, _summary(values)) for param, values in local.items()]
    group = group if group is not None else _model_group(all_owners)
    gathered: list[Any] = [mine]
    if group is not None and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        comms.all_gather_object(gathered, mine, group)
    if any(owner.index is not None for owner in all_owners.values()):
        return _any_ranks_plan(gathered, all_owners)
    _check_rank0_states_everywhere(gathered)
    return _Plan(dict(gathered[0]), [names for names, _ in gathered[0]])


def _any_ranks_plan(
    gathered: list[list[tuple[Names, Summary]]], all_owners: dict[nn.Parameter, Owner]
) -> _Plan:
    """Rule 2: every parameter some rank has state for, its state names over all ranks,
    values first from the ranks holding a piece of it."""
    per_param: dict[Names, list[Summary]] = {}
    for rank_summaries in gathered:
        for names, summary in rank_summaries:
            per_param.setdefault(names, []).append(summary)
    summaries: dict[Names, Summary] = {}
    for names, rank_summaries in per_param.items():
        merged = summaries[names] = {}
        for summary in sorted(rank_summaries, key=_holds_no_piece):  # stable: holders first
            for name, entry in summary.items():
                merged.setdefault(name, entry)
    by_names = {owner.fqns: owner for owner in all_owners.values()}
    return _Plan(summaries, _orig_params_order(list(summaries), by_names))


def _holds_no_piece(summary: Summary) -> bool:
    """Whether a rank's state of a parameter has only empty tensors (it holds no piece)."""
    return any(dtype is not None and numel == 0 for dtype, numel in summary.values())


def _model_group(all_owners: dict[nn.Parameter, Owner]) -> dist.ProcessGroup | None:
    """The group of the model's first managed parameter: the ranks that gather together."""
    for owner in all_owners.values():
        if owner.instance is not None:
            return owner.instance.process_group
    return None


def _check_rank0_states_everywhere(gathered: list[list[tuple[Names, Summary]]]) -> None:
    wanted = [names for names, _ in gathered[0]]
    missing = {}
    for rank, rank_summaries in enumerate(gathered[1:], start=1):
        held = {names for names, _ in rank_summaries}
        lacking = [list(names) for names in wanted if names not in held]
        if lacking:
            missing[rank] = lacking
    if missing:
        lines = "\n".join(f"rank {rank}: {names}" for rank, names in missing.items())
        raise RuntimeError(
            "FSDP currently requires each rank to have at least the optimizer states needed "
            "by rank 0's optimizer but some ranks are missing some of those states: every "
            "rank's optimizer must hold state for the parameters rank 0's holds state for; "
            f"missing:\n{lines}"
        )


def _orig_params_order(names: list[Names], by_names: dict[Names, Owner]) -> list[Names]:
    """Unmanaged parameters sorted by name, then each instance's sorted, instances in the
    order their first name sorts (as torch's wrapper lists them)."""
    runs: dict[Any, list[Names]] = {None: []}
    for each in sorted(names):
        owner = by_names.get(each)  # None: a parameter only another rank's model has
        runs.setdefault(owner.instance if owner else None, []).append(each)
    return [each for run in runs.values() for each in run]


# -- whole tensors from shards ---------------------------------------------------------------


def _whole_states(
    owner: Owner, local: dict[str, Any], plan: _Plan, options: SaveOptions
) -> dict[str, dict[str, Any]]:
    """Per original name, its state as saved (collective for managed parameters)."""
    instance = owner.instance
    if instance is None:
        states = {owner.fqns[0]: {k: copy_value(v) for k, v in local.items()}}
    elif owner.index is None:
        states = _whole_flat_states(owner, local)
    else:
        states = _whole_orig_state(owner, local, plan.summaries[owner.fqns])
    for values in states.values():
        for name, value in values.items():
            if not options.full and is_shardable(value) and _is_sharded(instance):
                assert instance is not None
                value = sd.chunk_sharded(value, instance, options.use_dtensor)
            if options.offload and isinstance(value, torch.Tensor):
                value = value.cpu()
            values[name] = value
    return states


def _is_sharded(instance: WrapperState | None) -> bool:
    """Whether sharded optimizer state dicts chunk this instance's state (NO_SHARD: whole)."""
    return instance is not None and instance.strategy is not ShardingStrategy.NO_SHARD


def is_shardable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _whole_flat_states(owner: Owner, local: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A flat parameter's state tensors are flat shards: gathered, then cut per original."""
    instance = owner.instance
    assert instance is not None and instance.handle is not None
    layout = instance.handle.layout
    result: dict[str, dict[str, Any]] = {fqn: {} for fqn in owner.fqns}
    # Tensors cut into the originals first, then what they share (``step``), as torch's.
    for name in sorted(local, key=lambda name: not is_shardable(local[name])):
        value = local[name]
        flat = _gather_flat(value, instance) if is_shardable(value) else None
        for i, fqn in enumerate(owner.fqns):
            if flat is None:
                result[fqn][name] = copy_value(value)
            else:
                piece = flat.narrow(0, layout.param_offsets[i], layout.numels[i])
                result[fqn][name] = piece.view(layout.shapes[i]).clone()
    return result


def _whole_orig_state(
    owner: Owner, local: dict[str, Any], summary: Summary
) -> dict[str, dict[str, Any]]:
    """One original parameter's state (``use_orig_params=True``), gathered from its pieces.

    Ranks may hold no piece of it (and so, for some optimizers, no state): ``summary``, the
    state names, dtypes and non-tensor values over all ranks, says what to gather.
    """
    instance, index = owner.instance, owner.index
    assert instance is not None and index is not None and instance.handle is not None
    piece = instance.handle.rank_shard.params[index]
    layout = instance.handle.layout
    out: dict[str, Any] = {}
    holds_piece = piece.in_shard and piece.numel_in_shard > 0
    for name, (dtype, value) in summary.items():
        if dtype is None:  # rule 2: a value of the ranks holding a piece
            out[name] = copy_value(local[name] if holds_piece and name in local else value)
            continue
        shard = torch.zeros(layout.shard_numel, dtype=dtype, device=instance.device)
        if name in local and piece.in_shard and piece.numel_in_shard:
            shard.narrow(0, piece.offset_in_shard, piece.numel_in_shard).copy_(
                local[name].reshape(-1)
            )
        flat = _gather_flat(shard, instance)
        whole = flat.narrow(0, layout.param_offsets[index], layout.numels[index])
        out[name] = whole.view(layout.shapes[index]).clone()
    return {owner.fqns[0]: out}


def copy_value(value: Any) -> Any:
    """A tensor the optimizer does not own (its ``step`` is updated in place), else as is."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _gather_flat(shard: torch.Tensor, instance: WrapperState) -> torch.Tensor:
    """All-gather a flat shard (``shard_numel`` elements) over the instance's shard group."""
    handle = instance.handle
    assert handle is not None
    if shard.numel() != handle.layout.shard_numel:
        raise ValueError(
            f"optimizer state of {shard.numel()} elements for a flat parameter shard of "
            f"{handle.layout.shard_numel}: the optimizer state does not belong to this model"
        )
    shard = shard.reshape(-1).to(instance.device)
    if instance.world_size == 1:
        return shard
    output = shard.new_empty(handle.layout.padded_numel)
    comms.all_gather(output, shard.contiguous(), instance.mesh_info.shard_group)
    return output
