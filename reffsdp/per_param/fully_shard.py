"""``fully_shard``: shard a module's parameters and install the FSDP hooks.

Apply it bottom-up: to each block first, then to the model. Each call claims the
parameters of its module(s) that no earlier call claimed, so a block's parameters belong
to the block's group and the rest (embeddings, final norm, ...) to the root's group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.compile_support import mark_fsdp_managed
from ..core.mesh import MeshInfo
from ..core.param_group import GroupSettings, ParamGroup
from ..core.torch_internals import is_fsdp_managed, register_composable_api
from .api import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    param_dtype_override,
)
from .mesh import default_mesh, device_for, mesh_info_for, spmd_mesh_info
from .module import FSDPModule
from .placement import GroupMeshes, check_placement_fn_allowed, resolve_placement
from .sharded_param import ShardedParam, unique_params
from .state import FSDPState, state_of

_fsdp_classes: dict[type, type] = {}


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
):
    """Shard ``module``'s parameters over ``mesh`` and make it an :class:`FSDPModule`.

    Parameters become ``DTensor``s sharded on dim 0 (or per ``shard_placement_fn``). In
    forward each group is all-gathered just before use and, per ``reshard_after_forward``,
    freed after; in backward gradients are reduce-scattered. Returns ``module`` itself.

    With ``dp_mesh_dims``, ``mesh`` is the full SPMD mesh the (DTensor) parameters live on
    and the named dims are the data-parallel ones (see [Note: SPMD meshes] in
    ``reffsdp/per_param/mesh.py``).
    """
    modules = _as_modules(module)
    _check_modules(modules)
    _check_argument_types(
        mesh, shard_placement_fn, mp_policy, offload_policy, ignored_params, dp_mesh_dims
    )
    mesh = mesh if mesh is not None else default_mesh()
    if dp_mesh_dims is not None:
        mesh_info = spmd_mesh_info(mesh, dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names)
    else:
        mesh_info = mesh_info_for(mesh)
    device = device_for(mesh)
    # Checked up front, on fully_shard's own mesh, as torch does; other meshes per group.
    _resolve_reshard_after_forward(reshard_after_forward, mesh_info)

    managed = _managed_modules(modules)
    ignored = {id(p) for p in ignored_params or ()}
    sharded = _shard_params(
        modules, managed, ignored, mesh_info, device, shard_placement_fn, offload_policy, mp_policy
    )
    _move_buffers(managed, device)
    groups = _groups_by_mesh(modules, sharded, device, mp_policy, reshard_after_forward)
    FSDPState(modules, groups, device, mp_policy, auto_reshard_root=reshard_after_forward is None)
    for m in modules:
        _swap_class(m)
        register_composable_api(m, "fully_shard")  # torch's replicate then skips m
    mark_fsdp_managed(managed)  # also read by _managed_modules, for nesting order
    return module


def _as_modules(module: Any) -> tuple[nn.Module, ...]:
    if isinstance(module, nn.Module):
        return (module,)
    if not isinstance(module, list):
        raise TypeError(
            f"fully_shard expects module to be an nn.Module or a list of them, got "
            f"{type(module).__name__}"
        )
    for item in module:
        if not isinstance(item, nn.Module):
            raise TypeError(
                f"fully_shard expects module to be a list of nn.Modules, but it holds a "
                f"{type(item).__name__}"
            )
    if not module:
        raise ValueError("fully_shard expects at least one module, got an empty list")
    return tuple(module)


def _check_argument_types(
    mesh, shard_placement_fn, mp_policy, offload_policy, ignored_params, dp_mesh_dims
) -> None:
    """Refuse arguments of the wrong type up front, naming them (torch fails deeper inside)."""
    _check_type("mesh", mesh, DeviceMesh, "init_device_mesh(...)", optional=True)
    _check_type("mp_policy", mp_policy, MixedPrecisionPolicy, "MixedPrecisionPolicy(...)")
    _check_type("offload_policy", offload_policy, OffloadPolicy, "CPUOffloadPolicy()")
    _check_type(
        "dp_mesh_dims",
        dp_mesh_dims,
        DataParallelMeshDims,
        "DataParallelMeshDims(...)",
        optional=True,
    )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            "fully_shard expects shard_placement_fn to be a function of a parameter, got "
            f"{shard_placement_fn!r}"
        )
    if ignored_params is not None and not (
        isinstance(ignored_params, Iterable)
        and all(isinstance(p, nn.Parameter) for p in ignored_params)
    ):
        raise TypeError(
            "fully_shard expects ignored_params to be a set of nn.Parameters, got "
            f"{type(ignored_params).__name__}"
        )


def _check_type(name: str, value: Any, cls: type, example: str, *, optional: bool = False):
    if isinstance(value, cls) or (optional and value is None):
        return
    got = f"the class {value.__name__}" if isinstance(value, type) else repr(value)
    raise TypeError(f"fully_shard expects {name} to be a {cls.__name__}, e.g. {example}; got {got}")


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward in (
            nn.ModuleList.forward,
            nn.ModuleDict.forward,
        ):
            raise ValueError(
                "fully_shard does not support containers that do not implement forward: "
                f"{type(m).__name__} has no forward of its own; shard each child or the module "
                "that calls them"
            )
        if state_of(m) is not None:
            raise AssertionError(
                f"fully_shard has already been applied to {type(m).__name__}. Each distinct "
                "composable distributed API can only be applied to a module once. To change "
                "its settings, use the FSDPModule setters (e.g. set_reshard_after_forward)"
            )


def _resolve_reshard_after_forward(
    value: bool | int | None, mesh_info: MeshInfo, *, warn: bool = True
) -> tuple[bool, MeshInfo | None]:
    """``(reshard?, post-forward mesh)``; an int ``k`` reshards to groups of ``k`` ranks.
    ``warn``: about ``k = 1`` (once per call, not per group)."""
    if value is None or isinstance(value, bool):
        return value is not False, None
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward must be a bool or int, got {value!r}")
    if mesh_info.spmd is not None:
        raise NotImplementedError(
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims): "
            f"got reshard_after_forward={value}; pass True or False"
        )
    shard_size = mesh_info.shard_size
    if value < 1 or value > shard_size or shard_size % value != 0:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard size {shard_size} "
            f"and lie in [1, {shard_size}]"
        )
    if value == 1:
        if warn:
            warnings.warn(
                "reshard_after_forward=1 keeps every parameter unsharded after forward; "
                "pass False instead",
                stacklevel=3,
            )
        return False, None
    if value == shard_size:
        return True, None
    # Rows of k consecutive ranks; dim 1 of this mesh is the backward all-gather group.
    ranks = mesh_info.mesh.mesh.reshape(-1, value)
    post_forward_mesh = DeviceMesh(
        mesh_info.device_type,
        ranks,
        mesh_dim_names=("post_forward_replicate", "post_forward_shard"),
    )
    return True, MeshInfo(post_forward_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def _managed_modules(roots: tuple[nn.Module, ...]) -> list[nn.Module]:
    """Depth-first from the roots, children before their parent (torch's order, which
    orders a call's parameters and so its groups), not entering modules another call
    already sharded.

    A module that an earlier call manages without being its root means that call was applied
    top-down (parent before child): its parameters are already sharded, so refuse clearly.
    (The marker lives on the module, not the parameter: a weak reference to a parameter
    would make ``nn.Module._apply`` unable to swap it in ``.to()``/``to_empty()``.)
    """
    managed: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if is_fsdp_managed(m):
            raise ValueError(
                f"{type(m).__name__} is already managed by an enclosing fully_shard call; "
                "apply fully_shard bottom-up (children before their parent)"
            )
        for child in m.children():
            if state_of(child) is None:
                visit(child)
        managed.append(m)  # after its children, as torch lists them

    for root in roots:
        visit(root)
    return managed


def _shard_params(
    roots, managed, ignored, mesh_info, device, shard_placement_fn, offload_policy, mp_policy
) -> list[ShardedParam]:
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    pin_memory = offload and offload_policy.pin_memory
    triples = [
        (m, name, p)
        for m in managed
        for name, p in m.named_parameters(recurse=False, remove_duplicate=False)
        if id(p) not in ignored
    ]
    if triples:
        check_placement_fn_allowed(shard_placement_fn, mesh_info)
    paths = _module_paths(roots)
    meshes = GroupMeshes(mesh_info)
    sharded = []
    for param, refs in unique_params(triples):
        prefix = paths[id(refs[0].module)]
        name = f"{prefix}.{refs[0].name}" if prefix else refs[0].name
        result = shard_placement_fn(param) if shard_placement_fn is not None else None
        place = resolve_placement(result, param, meshes, name, type(refs[0].module).__name__)
        sharded_param = ShardedParam(
            param,
            refs,
            place.mesh_info,
            device,
            place.shard_dim,
            name=name,
            offload=offload,
            pin_memory=pin_memory,
            param_dtype_override=param_dtype_override(mp_policy, param),
            mp_policy=mp_policy,
        )
        sharded.append(sharded_param)
    # Register the sharded parameters only once every parameter passed its checks, so an
    # error leaves the module as it was.
    for sharded_param in sharded:
        for ref in sharded_param.refs:
            ref.set(sharded_param.sharded_param)
    return sharded


def _groups_by_mesh(
    modules: tuple[nn.Module, ...],
    sharded: list[ShardedParam],
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | int | None,
) -> list[ParamGroup]:
    """One group per mesh, ordered by their first parameters; each resolves
    ``reshard_after_forward`` on its own mesh (rules 1 and 3 of [Note: per-parameter meshes]
    in ``placement``)."""
    by_mesh: dict[int, list[ShardedParam]] = {}
    for param in sharded:
        by_mesh.setdefault(id(param.mesh_info), []).append(param)
    name = f"fully_shard group of {', '.join(type(m).__name__ for m in modules)}"
    groups = []
    for members in by_mesh.values():
        mesh_info = members[0].mesh_info
        reshard, post_forward = _resolve_reshard_after_forward(
            reshard_after_forward, mesh_info, warn=False
        )
        group = ParamGroup(
            members,
            f"{name} on {mesh_info.mesh}" if len(by_mesh) > 1 else name,
            mesh_info,
            device,
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            settings=GroupSettings(reshard_after_forward=reshard),
            post_forward_mesh_info=post_forward,
        )
        groups.append(group)
    return groups


def _module_paths(roots: tuple[nn.Module, ...]) -> dict[int, str]:
    """Each module's path under the module(s) given to ``fully_shard``, for messages."""
    paths: dict[int, str] = {}
    for root in roots:
        for path, module in root.named_modules():
            paths.setdefault(id(module), path)
    return paths


def _move_buffers(managed: list[nn.Module], device: torch.device) -> None:
    for m in managed:
        for name, buffer in m.named_buffers(recurse=False, remove_duplicate=False):
            if buffer.device.type != "meta" and buffer.device != device:
                setattr(m, name, buffer.to(device))  # stays a buffer, persistent or not


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    fsdp_cls = _fsdp_classes.get(cls)
    if fsdp_cls is None:

        def __deepcopy__(self, memo):  # noqa: N807
            raise AssertionError(
                "FSDP does not support deepcopy: copy.deepcopy of a fully_shard module would "
                "copy its sharded parameters without their state. Please use state dict for "
                "serialization (state_dict() / load_state_dict() into a fresh sharded module)"
            )

        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": __deepcopy__})
        _fsdp_classes[cls] = fsdp_cls
    module.__class__ = fsdp_cls


def _state(module: nn.Module) -> FSDPState | None:
    return state_of(module)


fully_shard.state = _state  # type: ignore[attr-defined]
fully_shard.__module__ = "reffsdp"
