"""Model state dicts of the wrapper API: the three ``StateDictType`` s and their hooks.

[Note: wrapper state dicts]
Every ``FullyShardedDataParallel`` instance holds a state-dict type and two configs (model
and optimizer), set for a whole tree at once by ``set_state_dict_type``. ``state_dict()``
and ``load_state_dict()`` stay ``nn.Module``'s own: four hooks per instance reshape what
they see.

* ``FULL_STATE_DICT``: the pre-hook all-gathers the flat parameter (in full precision) and
  registers each original parameter as a full-size ``nn.Parameter`` view of it, hiding the
  flat parameter; ``nn.Module`` then saves or loads them under their original names. The
  post-hook clones the value under every name of every original parameter (or copies it to
  CPU) and reshards: a value left viewing the gathered buffer would be read after that
  buffer is freed (a crash, or another tensor's bytes). On load the post-hook first copies
  this rank's chunk of the gathered buffer back into the shard.
* ``SHARDED_STATE_DICT``: as FULL, but each full parameter is then chunked on dim 0 over the
  shard group (``torch.chunk`` semantics, like ``Shard(0)``). A flat-parameter shard cuts
  a 2-D weight in the middle of a row, which neither ``DTensor`` nor ``ShardedTensor`` can
  describe, so the whole parameter is gathered first, as torch does. On load each value is
  gathered back to a full tensor and loaded as with FULL.
* ``LOCAL_STATE_DICT``: the flat parameter's shard as it is, a 1-D ``ShardedTensor`` of the
  flat parameter's numel (tail padding left out), under ``<prefix>_flat_param``. Its layout
  depends on the world size, so it loads only at the world size that saved it.

[Note: names in state dicts]
Keys are the names of the model without any wrapper, as torch's are:

1. Each post-hook strips ``_fsdp_wrapped_module.`` below its prefix (inner instances first,
   so the root sees clean names), keeping the order ``nn.Module`` produced. Each load
   pre-hook puts the prefix back on every key below its own prefix, so nested instances and
   ``nn.Module``'s recursion find their keys; the load post-hook strips it again from
   missing and unexpected keys, so ``strict`` reports original names.
2. An original parameter has as many names as ``nn.Module.state_dict`` finds paths to it:
   a tied weight one per module holding it, a shared module's parameters one per path to
   the module. :func:`param_names` walks the wrapped module for them at each call, so
   every name is converted (chunked, copied, gathered back) and none is left behind.
3. Activation-checkpoint wrappers (torch's ``checkpoint_wrapper``) strip their own
   ``_checkpoint_wrapped_module.`` in their hooks; :func:`param_names` walks the modules'
   current paths, so a wrapper put around a module after wrapping is seen too. The flat
   parameter is registered on the module inside such a wrapper (``FullyShardedDataParallel
   .module``), where the wrapper's load hook sends ``_flat_param`` (a local state dict),
   and where it still is when ``apply_activation_checkpointing`` wraps the wrapped module
   itself later. Optimizer state dicts name parameters by ``FlatParamHandle.fqns``, which
   leave the wrapper's prefix out too.

Sharded values are ``ShardedTensor`` s, as torch's are, unless the config asks for
``_use_dtensor`` (set automatically when the wrapper was given a ``device_mesh``): then
they are ``DTensor`` s with ``Shard(0)`` on the shard dimension of the wrapper's mesh.
Both load through ``torch.distributed.checkpoint``. ``NO_SHARD`` instances always give
full state dicts (with a warning), as torch's do.

``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict``, called
through ``reffsdp.checkpoint``, drive these same hooks and the optimizer functions of
``optim_state.py`` through ``state_dict_type``: see [Note: DCP's state-dict functions and
this wrapper] in ``dcp_support.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from ..core import comms
from ..core.torch_internals import (
    CHECKPOINT_WRAPPED_MODULE,
    is_sharded_tensor,
    local_shard,
    registered_children,
    sharded_tensor,
)
from . import full_params
from .config import describe
from .full_params import WRAPPER_PREFIX as WRAPPED_PREFIX
from .state import FLAT_PARAM, WrapperState, state_of, states_under

_CONFIG_TYPES: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


def clean_name(name: str) -> str:
    """``name`` without the wrapper's module prefixes (activation checkpointing's too)."""
    return name.replace(WRAPPED_PREFIX, "").replace(f"{CHECKPOINT_WRAPPED_MODULE}.", "")


# -- settings -------------------------------------------------------------------------------


def init_state_dict(instance: WrapperState) -> None:
    """At construction: FULL_STATE_DICT with default configs, and the four hooks (on the
    instance's module, each finding the instance's state there)."""
    device_mesh = instance.config.device_mesh
    instance.device_mesh = device_mesh  # sharded state dicts then give DTensors
    if device_mesh is None:
        _forget_inherited_mesh(instance)
    instance.state_dict_settings = StateDictSettings(
        StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
    )
    instance.orig_buffer_dtypes = _own_buffer_dtypes(instance)
    module = instance.module
    module.register_state_dict_pre_hook(_pre_state_dict_hook)
    module.register_state_dict_post_hook(_post_state_dict_hook)
    module.register_load_state_dict_pre_hook(_pre_load_state_dict_hook)
    module.register_load_state_dict_post_hook(_post_load_state_dict_hook)


def _forget_inherited_mesh(root: WrapperState) -> None:
    """Children that auto-wrapping gave the mesh a hybrid root built from its process groups
    were, like the root, given process groups: no DTensors, and LOCAL_STATE_DICT works."""
    built = root.mesh_info.mesh
    for child in states_under(root.module)[1:]:
        if built is not None and child.device_mesh is built:
            child.device_mesh = None


def _own_buffer_dtypes(instance: WrapperState) -> dict[str, torch.dtype]:
    """Clean names (below the wrapped module) and dtypes of the floating-point buffers of
    the modules this instance owns, before mixed precision casts them."""
    own = {id(m) for m in instance.own_modules()}
    dtypes = {}
    for name, module in instance.wrapped.named_modules(remove_duplicate=False):
        if id(module) not in own:
            continue
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                dtypes[clean_name(f"{name}.{buffer_name}" if name else buffer_name)] = buffer.dtype
    return dtypes


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
    *,
    warn: bool = True,
) -> StateDictSettings:
    """Set every instance under ``module``; returns the settings they had before. ``warn``:
    torch's deprecation warning (its own ``get_state_dict`` sets the type silently)."""
    if warn:
        warnings.warn(
            "FSDP.state_dict_type() and FSDP.set_state_dict_type() are deprecated in torch in "
            "favour of torch.distributed.checkpoint.state_dict.get_state_dict() and "
            "set_state_dict(); for reffsdp's wrapper, take those from reffsdp.checkpoint",
            FutureWarning,
            stacklevel=3,
        )
    _check_state_dict_type(state_dict_type)
    config_type, optim_config_type = _CONFIG_TYPES[state_dict_type]
    state_dict_config = state_dict_config if state_dict_config is not None else config_type()
    if optim_state_dict_config is None:
        optim_state_dict_config = optim_config_type()
    for name, given, expected in (
        ("state_dict_config", state_dict_config, config_type),
        ("optim_state_dict_config", optim_state_dict_config, optim_config_type),
    ):
        if type(given) is not expected:
            raise RuntimeError(
                f"Expected {name} of type {expected.__name__} but got {type(given).__name__}: "
                f"{state_dict_type} needs a {expected.__name__}"
            )
    previous = None
    for instance in states_under(module):
        settings = instance.state_dict_settings
        assert settings is not None
        if previous is None:
            previous = settings
        elif settings.state_dict_type != previous.state_dict_type or type(
            settings.state_dict_config
        ) is not type(previous.state_dict_config):
            raise AssertionError("every FullyShardedDataParallel must share one state-dict type")
        instance.state_dict_settings = StateDictSettings(
            state_dict_type, state_dict_config, optim_state_dict_config
        )
    if previous is None:  # torch returns a settings object of Nones here
        return StateDictSettings(None, None, None)  # type: ignore[arg-type]
    return previous


class StateDictTypeError(TypeError, KeyError):
    """A ``state_dict_type`` that is no ``StateDictType`` (its name as a string, say): a
    ``TypeError``, and the ``KeyError`` torch's wrapper raises looking it up."""

    __str__ = Exception.__str__  # the message as written, not quoted as a KeyError's key


def _check_state_dict_type(state_dict_type: Any) -> None:
    if isinstance(state_dict_type, StateDictType):
        return
    # Its name, or torch's member of that name.
    member = getattr(state_dict_type, "name", state_dict_type)
    if not isinstance(member, str) or member not in StateDictType.__members__:
        member = StateDictType.SHARDED_STATE_DICT.name
    raise StateDictTypeError(
        f"state_dict_type must be a reffsdp.StateDictType, got {describe(state_dict_type)}; "
        f"pass the member, such as StateDictType.{member} (from reffsdp)"
    )


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings every instance under ``module`` shares (``AssertionError`` if they differ)."""
    found: StateDictSettings | None = None
    for instance in states_under(module):
        settings = instance.state_dict_settings
        if found is None:
            found = settings
        elif settings != found:
            raise AssertionError(
                f"every FullyShardedDataParallel must share one state-dict setting, got "
                f"{settings} and {found}"
            )
    if found is None:
        raise ValueError(f"no FullyShardedDataParallel instance in {type(module).__name__}")
    return found


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
    *,
    warn: bool = True,
) -> Iterator[None]:
    """:func:`set_state_dict_type` for the duration of a ``with`` block."""
    previous = set_state_dict_type(
        module, state_dict_type, state_dict_config, optim_state_dict_config, warn=warn
    )
    try:
        yield
    finally:
        if previous.state_dict_type is not None:
            set_state_dict_type(
                module,
                previous.state_dict_type,
                previous.state_dict_config,
                previous.optim_state_dict_config,
                warn=warn,
            )


def _settings(instance: WrapperState) -> StateDictSettings:
    assert instance.state_dict_settings is not None, "init_state_dict() sets them"
    return instance.state_dict_settings


def _effective_type(instance: WrapperState) -> StateDictType:
    """The type in force; NO_SHARD instances have only full state dicts, as in torch."""
    kind = _settings(instance).state_dict_type
    if kind is StateDictType.LOCAL_STATE_DICT and instance.device_mesh is not None:
        raise RuntimeError(
            f"{instance} was given a device_mesh: LOCAL_STATE_DICT is not supported "
            "with one (as in torch); use SHARDED_STATE_DICT"
        )
    if instance.strategy is ShardingStrategy.NO_SHARD:
        if kind is not StateDictType.FULL_STATE_DICT:
            warnings.warn(
                f"{instance} uses NO_SHARD: it saves and loads a full state dict instead of {kind}",
                stacklevel=4,
            )
        return StateDictType.FULL_STATE_DICT
    return kind


def param_names(instance: WrapperState) -> list[str]:
    """Every name under which ``nn.Module.state_dict`` lists a parameter of this instance's
    flat parameter, below the wrapped module, without wrapper prefixes: a tied parameter
    under each of its names, a shared module's parameters under each path to the module,
    at the modules' current paths (see [Note: names in state dicts])."""
    handle = instance.handle
    if handle is None:
        return []
    shown: dict[int, dict[str, None]] = {}  # id(module) -> its attributes that are ours
    for slots in handle.slots:
        for slot in slots:
            shown.setdefault(id(slot.module), {})[slot.name] = None
    names: dict[str, None] = {}

    def visit(module: nn.Module, path: str) -> None:
        for name in shown.get(id(module), ()):
            names[clean_name(path + name)] = None
        for child_name, child in registered_children(module).items():
            if child is not None and state_of(child) is None:
                visit(child, f"{path}{child_name}.")

    visit(instance.wrapped, "")
    return list(names)


# -- the unsharded window of FULL and SHARDED -------------------------------------------------
# Saving and loading a full or sharded state dict read and write the original parameters at
# full size: the same window as ``summon_full_params`` on one instance (full precision, the
# forward's low-precision buffers set aside), opened in the pre-hook and closed in the post.


def unshard_as_params(instance: WrapperState, *, write_back: bool) -> None:
    """Show the originals at full size until :func:`reshard`; with ``write_back``, what is
    loaded into them is kept in the shards."""
    window = contextlib.ExitStack()
    window.enter_context(
        full_params.summon_one(
            instance,
            writeback=write_back,
            rank0_only=False,
            offload_to_cpu=False,
            with_grads=False,
        )
    )
    instance.state_dict_window = window


def reshard(instance: WrapperState) -> None:
    """Close the window :func:`unshard_as_params` opened."""
    window, instance.state_dict_window = instance.state_dict_window, None
    assert window is not None, f"{instance}: no state-dict window is open"
    window.close()


# -- saving -----------------------------------------------------------------------------------


def _pre_state_dict_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    instance = state_of(module)
    assert instance is not None
    if _effective_type(instance) is not StateDictType.LOCAL_STATE_DICT:
        unshard_as_params(instance, write_back=False)


def _post_state_dict_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, _: Any
) -> None:
    instance = state_of(module)
    assert instance is not None
    _replace_prefix(state_dict, prefix + WRAPPED_PREFIX, prefix)
    kind = _effective_type(instance)
    config = _settings(instance).state_dict_config
    handle = instance.handle
    if kind is StateDictType.LOCAL_STATE_DICT:
        if handle is not None:
            state_dict[prefix + FLAT_PARAM] = _local_flat_param(instance, config.offload_to_cpu)
        return
    names = [prefix + name for name in param_names(instance)]  # views of the window
    try:
        if kind is StateDictType.FULL_STATE_DICT:
            if isinstance(config, FullStateDictConfig) and config.rank0_only and instance.rank:
                for key in [k for k in state_dict if k.startswith(prefix)]:
                    del state_dict[key]
                return
            for key in _own_keys(instance, state_dict, prefix):  # nested ones did theirs
                if key in names or config.offload_to_cpu:
                    state_dict[key] = _copy(state_dict[key], config.offload_to_cpu)
        else:
            for key in names:
                full = state_dict[key].detach()
                state_dict[key] = chunk_sharded(full, instance, _use_dtensor(instance, config))
                if config.offload_to_cpu:
                    state_dict[key] = state_dict[key].cpu()
            if config.offload_to_cpu:
                for key in _own_keys(instance, state_dict, prefix):
                    if key not in names:
                        state_dict[key] = state_dict[key].cpu()
        _restore_buffer_dtypes(instance, state_dict, prefix)
    finally:
        reshard(instance)


def _restore_buffer_dtypes(instance: WrapperState, state_dict: dict[str, Any], prefix: str):
    """Full and sharded state dicts hold buffers in the dtype they had before the
    instance's ``MixedPrecision.buffer_dtype`` cast them, as torch's do (local ones keep the
    cast)."""
    buffer_dtype = instance.config.precision.buffer_dtype
    if buffer_dtype is None:
        return
    for name, dtype in instance.orig_buffer_dtypes.items():
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.dtype == buffer_dtype != dtype:
            state_dict[prefix + name] = value.to(dtype)


def _own_keys(instance: WrapperState, state_dict: dict[str, Any], prefix: str):
    """Keys below ``prefix`` that no nested instance saved (this instance's tensors)."""
    nested = tuple(
        prefix + clean_name(f"{name}.")
        for name, module in instance.wrapped.named_modules()
        if name and state_of(module) is not None
    )
    return [k for k in state_dict if k.startswith(prefix) and not k.startswith(nested)]


def _copy(tensor: torch.Tensor, to_cpu: bool) -> torch.Tensor:
    """A copy that survives the reshard: on CPU if asked (a copy even if already there)."""
    if to_cpu:
        return tensor.detach().to("cpu", copy=True)
    return tensor.detach().clone()


def _local_flat_param(instance: WrapperState, to_cpu: bool) -> torch.Tensor:
    """This rank's shard of the flat parameter, tail padding dropped, as a 1-D ShardedTensor."""
    handle = instance.handle
    assert handle is not None
    layout, rank = handle.layout, instance.rank
    chunks = _flat_chunks(layout.total_numel, layout.shard_numel, instance.world_size)
    local = []
    if rank < len(chunks):
        data = handle.local_shard.detach().narrow(0, 0, chunks[rank][1])
        local = [local_shard(data, [chunks[rank][0]], rank)]
    tensor = _sharded_tensor(
        local, [([o], [n]) for o, n in chunks], torch.Size([layout.total_numel]),
        handle.orig_dtype, instance,
    )  # fmt: skip
    return tensor.cpu() if to_cpu else tensor


def _flat_chunks(total: int, shard_numel: int, world_size: int) -> list[tuple[int, int]]:
    """(offset, numel) of every non-empty chunk of a flat buffer of ``total`` elements."""
    chunks = []
    for rank in range(world_size):
        start = rank * shard_numel
        numel = min(shard_numel, total - start)
        if numel > 0:
            chunks.append((start, numel))
    return chunks


def _use_dtensor(instance: WrapperState, config: Any) -> bool:
    return bool(getattr(config, "_use_dtensor", False)) or instance.device_mesh is not None


def chunk_sharded(full: torch.Tensor, instance: WrapperState, use_dtensor: bool) -> torch.Tensor:
    """``full`` chunked on dim 0 over the instance's shard group: this rank keeps a clone of
    its chunk. Three rows on two ranks: rank 0 keeps rows 0-1, rank 1 row 2."""
    world_size, rank = instance.world_size, instance.rank
    chunks = full.chunk(world_size, dim=0)
    if use_dtensor:
        mesh_info = instance.mesh_info
        placements = [Replicate()] * mesh_info.mesh.ndim
        placements[mesh_info.shard_mesh_dim] = DShard(0)
        local = chunks[rank].clone() if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
        return DTensor.from_local(
            local, mesh_info.mesh, placements, run_check=False, shape=full.shape,
            stride=full.stride(),
        )  # fmt: skip
    rows = -(-full.shape[0] // world_size)  # every chunk but the last has this many
    local = []
    if rank < len(chunks):
        offsets = [rank * rows] + [0] * (full.dim() - 1)
        local = [local_shard(chunks[rank].clone(), offsets, rank)]
    layout = [
        ([r * rows] + [0] * (full.dim() - 1), list(chunk.shape)) for r, chunk in enumerate(chunks)
    ]
    return _sharded_tensor(local, layout, full.shape, full.dtype, instance)


def _sharded_tensor(
    local: list[Any],
    layout: list[tuple[list[int], list[int]]],
    size: torch.Size,
    dtype: torch.dtype,
    instance: WrapperState,
) -> torch.Tensor:
    """A ShardedTensor from this rank's shards and every shard's (offsets, sizes), built
    without communication (every rank computes the same layout)."""
    group = instance.process_group
    device = instance.device.type
    placed = [
        (offsets, sizes, f"rank:{dist.get_global_rank(group, r)}/{_device(device, r)}")
        for r, (offsets, sizes) in enumerate(layout)
    ]
    return sharded_tensor(local, placed, size, dtype, group)


def _device(device_type: str, rank: int) -> str:
    if device_type == "cpu":
        return "cpu"
    return f"{device_type}:{rank % max(torch.accelerator.device_count(), 1)}"


def full_tensor(value: torch.Tensor, instance: WrapperState) -> torch.Tensor:
    """A DTensor or dim-0-chunked ShardedTensor gathered whole; plain tensors as they are."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if not is_sharded_tensor(value):
        return value
    size = value.size()
    group, world_size = instance.process_group, instance.world_size
    rows = -(-size[0] // world_size)
    device = instance.device
    padded = torch.zeros((rows, *size[1:]), dtype=value.dtype, device=device)
    local = value.local_shards()
    if len(local) > 1:
        raise ValueError(f"expected at most one shard per rank, got {len(local)}")
    if local:
        padded.narrow(0, 0, local[0].tensor.shape[0]).copy_(local[0].tensor)
    gathered = torch.empty((rows * world_size, *size[1:]), dtype=value.dtype, device=device)
    comms.all_gather(gathered, padded, group)
    return gathered.narrow(0, 0, size[0])


# -- loading ----------------------------------------------------------------------------------


def _pre_load_state_dict_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    instance = state_of(module)
    assert instance is not None
    kind = _effective_type(instance)
    handle = instance.handle
    if kind is StateDictType.LOCAL_STATE_DICT:
        if handle is not None:
            _load_local_flat_param(instance, state_dict, prefix)
        _replace_prefix(state_dict, prefix, prefix + WRAPPED_PREFIX)
        return
    if handle is not None:
        for name in param_names(instance):
            key = prefix + name
            if key not in state_dict:
                continue  # nn.Module reports it missing
            value = state_dict[key]
            if kind is StateDictType.SHARDED_STATE_DICT:
                if not (is_sharded_tensor(value) or isinstance(value, DTensor)):
                    _wrong_type(instance, key, value, kind)
                state_dict[key] = full_tensor(value, instance)
            elif is_sharded_tensor(value) or isinstance(value, DTensor):
                _wrong_type(instance, key, value, kind)
    unshard_as_params(instance, write_back=True)
    _replace_prefix(state_dict, prefix, prefix + WRAPPED_PREFIX)


def _post_load_state_dict_hook(module: nn.Module, incompatible: Any) -> None:
    instance = state_of(module)
    assert instance is not None
    if _effective_type(instance) is not StateDictType.LOCAL_STATE_DICT:
        reshard(instance)
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [clean_name(key) for key in keys]


def _wrong_type(instance: WrapperState, key: str, value: Any, kind: StateDictType) -> NoReturn:
    """Raise for a value that ``kind`` cannot load: what it is, what saves such values, and
    how this instance shards (a plain tensor at a SHARDED load, say, may come from a model on
    one rank, which runs as NO_SHARD and saves plain tensors for every type)."""
    name, found = str(instance), _describe(value)
    here = _how_sharded(instance)
    if kind is StateDictType.LOCAL_STATE_DICT:
        problem = (
            f"{name} loads a LOCAL_STATE_DICT and expects a ShardedTensor of its flat "
            f"parameter for {key!r}, got {found}: it was saved under another StateDictType"
        )
        remedy = "Load it inside FullyShardedDataParallel.state_dict_type(model, <its type>)"
    elif kind is StateDictType.SHARDED_STATE_DICT:
        problem = (
            f"{name} loads a SHARDED_STATE_DICT and expects a ShardedTensor or DTensor for "
            f"{key!r}, got {found}. Plain tensors are what a FULL_STATE_DICT holds, and what "
            "a model whose parameters are whole on every rank (NO_SHARD, which FULL_SHARD and "
            f"SHARD_GRAD_OP become on a single rank) saves for every type; this instance {here}"
        )
        remedy = "Load it inside FullyShardedDataParallel.state_dict_type(model, FULL_STATE_DICT)"
    elif instance.strategy is ShardingStrategy.NO_SHARD:
        problem = (
            f"{name} {here}, but {key!r} is {found}, saved by a model that sharded its "
            "parameters (a SHARDED_STATE_DICT)"
        )
        remedy = (
            "Gather it into plain tensors first: save a FULL_STATE_DICT from that model, or "
            "load the checkpoint with torch.distributed.checkpoint into this model's state "
            "dict, which reshards it"
        )
    else:
        problem = (
            f"{name} loads a FULL_STATE_DICT and expects a plain tensor for {key!r}, got "
            f"{found}, as a SHARDED_STATE_DICT holds; this instance {here}"
        )
        remedy = (
            "Load it inside FullyShardedDataParallel.state_dict_type(model, SHARDED_STATE_DICT)"
        )
    raise ValueError(f"{problem}. {remedy}")


def _describe(value: Any) -> str:
    if is_sharded_tensor(value):
        shards = len(value.metadata().shards_metadata)
        return f"a ShardedTensor in {shards} shard{'s' if shards > 1 else ''}"
    if isinstance(value, DTensor):
        return f"a DTensor over {value.device_mesh.size()} ranks"
    return f"a plain {type(value).__name__}"


def _how_sharded(instance: WrapperState) -> str:
    mesh_info = instance.mesh_info
    if instance.strategy is ShardingStrategy.NO_SHARD:
        return (
            f"uses NO_SHARD on {_ranks(mesh_info.replicate_size)}: its parameters are whole "
            "on every rank, and it saves and loads plain tensors for every state-dict type"
        )
    strategy = instance.strategy.name
    return f"shards its parameters over {_ranks(mesh_info.shard_size)} ({strategy})"


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count > 1 else ''}"


def _load_local_flat_param(instance: WrapperState, state_dict: dict[str, Any], prefix: str) -> None:
    """Check that a LOCAL entry fits this world size and turn it into the padded shard."""
    handle = instance.handle
    assert handle is not None
    key = prefix + FLAT_PARAM
    if key not in state_dict:
        return  # nn.Module reports the flat parameter missing
    value = state_dict.pop(key)
    if not is_sharded_tensor(value):
        _wrong_type(instance, key, value, StateDictType.LOCAL_STATE_DICT)
    layout = handle.layout
    expected = _flat_chunks(layout.total_numel, layout.shard_numel, instance.world_size)
    saved = [(m.shard_offsets[0], m.shard_sizes[0]) for m in value.metadata().shards_metadata]
    if saved != expected or value.size() != torch.Size([layout.total_numel]):
        raise ValueError(
            f"{instance}: the LOCAL_STATE_DICT entry {key!r} was saved by "
            f"{len(saved)} ranks holding (offset, numel) {saved} of {value.size().numel()} "
            f"elements, but this instance shards {layout.total_numel} elements over "
            f"{instance.world_size} ranks as {expected}. A local state dict loads only at the "
            "world size that saved it; save a SHARDED_STATE_DICT or FULL_STATE_DICT to change "
            "the world size"
        )
    shard = torch.zeros_like(handle.local_shard)
    local = value.local_shards()
    if local:
        data = local[0].tensor.reshape(-1)
        shard.narrow(0, 0, data.numel()).copy_(data)
    if handle.use_orig_params:  # the flat parameter is no registered parameter: copy here
        with torch.no_grad():
            handle.local_shard.copy_(shard)
    else:
        state_dict[prefix + FLAT_PARAM] = shard


def _replace_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    """Rename keys starting with ``old`` to start with ``new``, keeping the dict's order."""
    if not any(key.startswith(old) for key in state_dict):
        return
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        state_dict[new + key[len(old) :] if key.startswith(old) else key] = value
