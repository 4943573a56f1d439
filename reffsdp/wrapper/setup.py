"""Constructor work for the wrapper API: which mesh, which device, which parameters.

Everything here runs once, in ``FullyShardedDataParallel.__init__``, before the instance
builds its flat parameter; none of it is needed during training.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..api import ShardingStrategy
from ..core import comms
from ..core.mesh import MeshInfo
from ..core.torch_internals import registered_parameters
from .config import HYBRID, WrapperConfig, describe, is_stand_in


def check_module(module: Any, wrapper_cls: type) -> None:
    """Refuse a module that cannot be wrapped (the other arguments are the config's to
    check: see [Note: the wrapper's configuration] in config.py)."""
    if isinstance(module, wrapper_cls):
        raise ValueError(
            f"the module is already a {wrapper_cls.__name__} (wrapping "
            f"{type(module.module).__name__}); wrap it once. To nest instances, wrap the "
            f"children first and then their parent, which may contain {wrapper_cls.__name__} "
            "instances (without an auto_wrap_policy)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {describe(module)}")


@dataclass(frozen=True)
class StandInMesh:
    """A 1-D mesh over a stand-in group: it answers what :class:`MeshInfo` asks of a mesh
    (group, size and local rank of its one dim) from the group's ``rank()`` and ``size()``."""

    group: Any
    device_type: str
    ndim: int = 1

    def get_group(self, mesh_dim: int = 0) -> Any:
        return self.group

    def size(self, mesh_dim: int = 0) -> int:
        return self.group.size()

    def get_local_rank(self, mesh_dim: int = 0) -> int:
        return self.group.rank()

    def get_rank(self) -> int:
        return self.group.rank()


def compute_device(
    module: nn.Module,
    device_id: int | torch.device | None,
    process_group: Any = None,
    device_mesh: DeviceMesh | None = None,
) -> torch.device:
    """``device_id``, else the first non-CPU parameter's device, else the current
    accelerator unless the collectives run on gloo (``device_mesh``'s device type, or the
    backend of ``process_group``, the default group when ``None``), else the CPU. torch's
    wrapper refuses a CPU-only machine, and a CPU module on gloo where a GPU is present; we
    run both on the CPU."""
    if device_id is not None:
        device = torch.device(device_id) if not isinstance(device_id, int) else None
        if device is None or (device.type != "cpu" and device.index is None):
            accelerator = torch.accelerator.current_accelerator()
            assert accelerator is not None, "an int device_id needs an accelerator"
            index = (
                device_id
                if isinstance(device_id, int)
                else torch.accelerator.current_device_index()
            )
            device = torch.device(accelerator.type, index)
        return device
    for param in module.parameters():
        if param.device.type not in ("cpu", "meta"):
            return param.device
    if torch.accelerator.is_available() and not _collectives_on_cpu(process_group, device_mesh):
        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def _collectives_on_cpu(process_group: Any, device_mesh: DeviceMesh | None) -> bool:
    if device_mesh is not None:
        return device_mesh.device_type == "cpu"
    if isinstance(process_group, tuple):  # hybrid: (intra-node, inter-node)
        process_group = process_group[0]
    if is_stand_in(process_group):
        return False  # no backend to ask
    return dist.is_initialized() and dist.get_backend(process_group) == "gloo"


def _mesh_of(group: Any, device_type: str) -> DeviceMesh | StandInMesh:
    if is_stand_in(group):
        return StandInMesh(group, device_type)
    return DeviceMesh.from_group(group, device_type)


def mesh_info_for_strategy(
    strategy: ShardingStrategy, config: WrapperConfig, device: torch.device
) -> MeshInfo:
    """The data-parallel mesh of one instance running ``strategy`` over the process group or
    device mesh of ``config``: who all-gathers and who all-reduces.

    FULL_SHARD / SHARD_GRAD_OP shard over the group; NO_SHARD only all-reduces over it;
    the hybrid strategies shard within ``(shard, replicate)`` groups.
    """
    process_group, device_mesh = config.process_group, config.device_mesh
    if not dist.is_initialized() and not is_stand_in(process_group):
        dist.init_process_group()
    device_type = device.type
    if strategy in HYBRID:
        mesh = _hybrid_mesh(process_group, device_mesh, device_type)
        return MeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{strategy.name} takes a 1-D device_mesh, got {device_mesh.ndim}-D; "
                "pass a 2-D mesh only with a hybrid strategy"
            )
        mesh = device_mesh
    else:
        group = process_group if process_group is not None else dist.group.WORLD
        if isinstance(group, tuple):
            raise ValueError(
                f"a (shard, replicate) pair of process groups needs a hybrid strategy, got "
                f"{strategy.name}"
            )
        mesh = _mesh_of(group, device_type)
    if strategy is ShardingStrategy.NO_SHARD:
        return MeshInfo(mesh, shard_mesh_dim=None, replicate_mesh_dim=0)
    return MeshInfo(mesh, shard_mesh_dim=0)


def _hybrid_mesh(process_group: Any, device_mesh: DeviceMesh | None, device_type: str):
    if device_mesh is not None:
        if device_mesh.ndim != 2:
            raise ValueError(
                f"a hybrid strategy needs a 2-D device_mesh (replicate, shard), got "
                f"{device_mesh.ndim}-D"
            )
        return device_mesh
    if process_group is None:
        return _intra_inter_node_mesh(device_type)
    if not (isinstance(process_group, tuple) and len(process_group) == 2):
        raise ValueError(
            "Expected process_group to be passed in as either None or a (shard_group, "
            "replicate_group) pair of ProcessGroups for a hybrid strategy, but got "
            f"{describe(process_group)}; a 2-D device_mesh works too"
        )
    shard_group, replicate_group = process_group
    shard_ranks = dist.get_process_group_ranks(shard_group)
    replicate_ranks = dist.get_process_group_ranks(replicate_group)
    world = dist.get_world_size()
    if len(shard_ranks) * len(replicate_ranks) != world:
        raise ValueError(
            f"the shard group ({len(shard_ranks)} ranks) times the replicate group "
            f"({len(replicate_ranks)} ranks) must cover the world ({world} ranks)"
        )
    # Row i of the mesh: the shard group that holds replicate rank i's copy.
    rows = _all_gather_ranks(shard_ranks, replicate_group)
    _check_tiling(rows, shard_ranks, replicate_ranks, world)
    mesh = torch.tensor(rows, dtype=torch.int)
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device_type,
        mesh=mesh,
        mesh_dim_names=("replicate", "shard"),
    )


def _all_gather_ranks(shard_ranks: list[int], replicate_group: dist.ProcessGroup):
    """Every replica's shard-group ranks, as rows (gathered over the replicate group)."""
    rows: list[Any] = [None] * dist.get_world_size(replicate_group)
    comms.all_gather_object(rows, shard_ranks, replicate_group)
    return rows


def _check_tiling(
    rows: list[list[int]], shard_ranks: list[int], replicate_ranks: list[int], world: int
) -> None:
    """The replicas' shard groups must hold every rank once, and this rank's replicate
    group must be the ranks at its position in them.

    Four ranks, shard groups ``[0, 1]`` and ``[2, 3]``: rank 0's replicate group must be
    ``[0, 2]`` (rows ``[[0, 1], [2, 3]]``, column 0); ``[0, 1]`` gives rows
    ``[[0, 1], [0, 1]]``, which hold rank 0 twice.
    """
    me = dist.get_rank()
    position = shard_ranks.index(me)
    column = [row[position] if position < len(row) else None for row in rows]
    flat = sorted(rank for row in rows for rank in row)
    if flat != list(range(world)) or column != replicate_ranks:
        raise ValueError(
            "process_group=(shard_group, replicate_group) must tile the world: every rank in "
            "one shard group, each replicate group holding the ranks at the same position "
            f"of the shard groups; on rank {me} the shard group is {shard_ranks}, the "
            f"replicate group {replicate_ranks}, and the replicas' shard groups {rows}"
        )


def _intra_inter_node_mesh(device_type: str) -> DeviceMesh:
    """Shard within a node (``LOCAL_WORLD_SIZE`` ranks, else accelerators per node), replicate
    across nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or torch.accelerator.device_count()
    per_node = per_node if per_node and world % per_node == 0 else world
    return init_device_mesh(
        device_type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard")
    )


@dataclass(frozen=True)
class Ignored:
    """What an instance never shards: ``modules`` holds every module of the ignored subtrees,
    ``params`` their parameters and any parameters ignored on their own."""

    modules: frozenset[nn.Module]
    params: frozenset[nn.Parameter]


def ignored_sets(module: nn.Module, config: WrapperConfig, wrapper_cls: type) -> Ignored:
    """The modules (with their subtrees) and parameters ``config`` says to leave alone."""
    items = config.ignored_states or config.ignored_modules or ()
    roots = [x for x in items if isinstance(x, nn.Module)]
    params = {x for x in items if isinstance(x, nn.Parameter)}
    modules: set[nn.Module] = set()
    for root in roots:
        for sub in root.modules():
            if isinstance(sub, wrapper_cls):
                raise ValueError(
                    f"an ignored module may not contain {wrapper_cls.__name__} instances"
                )
            modules.add(sub)
    if module in modules:
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself "
            f"will result in all parameters being ignored: every parameter of the "
            f"{type(module).__name__} stays unsharded and {wrapper_cls.__name__} has nothing "
            "to manage; wrap a parent module instead, or ignore only some children",
            stacklevel=4,
        )
    for sub in modules:
        params.update(sub.parameters(recurse=False))
    return Ignored(frozenset(modules), frozenset(params))


def materialize(
    module: nn.Module,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
    ignored_modules: set[nn.Module],
    wrapper_cls: type,
) -> None:
    """Modules built on the meta device get real storage, once each."""
    for sub in unwrapped_modules(module, ignored_modules, _is_instance(wrapper_cls)):
        tensors = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if not any(t.is_meta for t in tensors):
            continue
        if param_init_fn is not None:
            param_init_fn(sub)
            continue
        reset = getattr(sub, "reset_parameters", None)
        if not callable(reset):  # to_empty alone would leave uninitialized memory
            raise AttributeError(
                f"a {type(sub).__name__} module has parameters or buffers on the meta "
                "device but no reset_parameters() to initialize them once materialized; "
                "define reset_parameters() or pass param_init_fn"
            )
        sub.to_empty(device=device, recurse=False)
        reset()


def unwrapped_modules(
    module: nn.Module, ignored_modules: set[nn.Module], is_wrapper: Callable[[nn.Module], bool]
) -> list[nn.Module]:
    """``module``'s tree without ignored subtrees and without nested wrappers' trees."""
    found = []

    def visit(m: nn.Module) -> None:
        if m in ignored_modules or (m is not module and is_wrapper(m)):
            return
        found.append(m)
        for child in m.children():
            visit(child)

    visit(module)
    return found


def _is_instance(wrapper_cls: type) -> Callable[[nn.Module], bool]:
    return lambda module: isinstance(module, wrapper_cls)


def managed_params(module, ignored_modules, ignored_params, wrapper_cls, wrapped_name):
    """``[(param, [(owner module, attribute name, fqn), ...])]`` this instance flattens."""
    entries: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    prefixes = {id(module): ""}
    for sub in unwrapped_modules(module, ignored_modules, _is_instance(wrapper_cls)):
        prefix = prefixes[id(sub)]
        for child_name, child in sub.named_children():
            prefixes.setdefault(id(child), f"{prefix}{child_name}.")
        for name, param in registered_parameters(sub).items():
            if param is None or param in ignored_params or name == wrapped_name:
                continue
            entry = entries.setdefault(id(param), (param, []))
            entry[1].append((sub, name, f"{prefix}{name}"))
    return list(entries.values())


def move_to_device(
    modules: list[nn.Module], device: torch.device, offload: bool, wrapper_cls
) -> None:
    """Parameters and buffers of the instance's own modules onto the compute device."""
    for sub in modules:
        for param in registered_parameters(sub).values():
            if param is not None and param.device != device and not param.is_meta:
                if param.device.type != "cpu" and param.device != device:
                    raise ValueError(
                        f"a parameter is on {param.device} but device_id is {device}; move "
                        "the module or pass a matching device_id"
                    )
                with torch.no_grad():
                    param.data = param.data.to(device)
        for name, buffer in sub.named_buffers(recurse=False, remove_duplicate=False):
            if buffer.device != device and not buffer.is_meta:
                setattr(sub, name, buffer.to(device))  # stays a buffer, persistent or not


def sync_module_states(
    params: list[nn.Parameter], buffers: list[torch.Tensor], mesh_info: MeshInfo
) -> None:
    """Broadcast rank 0's parameters and buffers (per group: replicate first for hybrid)."""
    tensors = [t for t in [*params, *buffers] if not t.is_meta]
    groups = []
    if mesh_info.replicate_group is not None:
        groups.append(mesh_info.replicate_group)
    if mesh_info.shard_group is not None:
        groups.append(mesh_info.shard_group)
    with torch.no_grad():
        for group in groups:
            _check_same_shapes(tensors, group, torch.device(mesh_info.device_type))
            src = dist.get_global_rank(group, 0)
            for tensor in tensors:
                comms.broadcast(tensor.data, src, group)


def _check_same_shapes(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, device: torch.device
) -> None:
    """Before broadcasting: every rank of ``group`` must hold tensors of the same shapes and
    dtypes, or the broadcasts would hang or copy into the wrong tensors. Ranks all-gather a
    digest of their list, so every rank sees a mismatch and raises."""
    shapes = [f"{tuple(t.shape)} {t.dtype}" for t in tensors]
    digest = hashlib.sha256(repr(shapes).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=device)
    everyone = mine.new_empty(dist.get_world_size(group))
    comms.all_gather(everyone, mine, group)
    digests = everyone.tolist()
    differ = [rank for rank, value in enumerate(digests) if value != digests[0]]
    if differ:
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(
            "sync_module_states=True needs the same parameter and buffer shapes and dtypes on "
            f"every rank, but ranks {[ranks[r] for r in differ]} differ from rank {ranks[0]}; "
            f"rank {dist.get_rank()} has {len(shapes)} tensors: {shapes}"
        )


def strategy_for_group(strategy: ShardingStrategy, mesh_info: MeshInfo) -> ShardingStrategy:
    """The strategy an instance runs, warning as torch's wrapper does: ``NO_SHARD`` is
    deprecated, and FULL_SHARD / SHARD_GRAD_OP over one rank run as ``NO_SHARD`` (sharding
    over one rank holds everything whole; the original shapes show, as torch's). Hybrid
    strategies keep theirs: their replicas still all-reduce."""
    if strategy is ShardingStrategy.NO_SHARD:
        warnings.warn(
            "ShardingStrategy.NO_SHARD is deprecated (as in torch); use DistributedDataParallel",
            FutureWarning,
            stacklevel=4,
        )
    elif strategy not in HYBRID and mesh_info.shard_size == 1:
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size "
            "is 1: over one rank every parameter is whole anyway, so it only all-reduces",
            stacklevel=4,
        )
        return ShardingStrategy.NO_SHARD
    return strategy
