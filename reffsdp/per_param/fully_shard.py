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
from torch.distributed.tensor import Shard

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
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
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
    ``reffsdp/core/mesh.py``).
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
    reshard, post_forward_mesh_info = _resolve_reshard_after_forward(
        reshard_after_forward, mesh_info
    )

    managed = _managed_modules(modules)
    ignored = {id(p) for p in ignored_params or ()}
    sharded = _shard_params(
        modules, managed, ignored, mesh_info, device, shard_placement_fn, offload_policy, mp_policy
    )
    _move_buffers(managed, device)
    group = None
    if sharded:
        group = ParamGroup(
            sharded,
            f"fully_shard group of {', '.join(type(m).__name__ for m in modules)}",
            mesh_info,
            device,
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            settings=GroupSettings(reshard_after_forward=reshard),
            post_forward_mesh_info=post_forward_mesh_info,
        )
    FSDPState(modules, group, device, mp_policy, auto_reshard_root=reshard_after_forward is None)
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
                f"fully_shard has already been applied to {type(m).__name__}: fully_shard can "
                "only be applied to a module once; to change its settings, use the "
                "FSDPModule setters (e.g. set_reshard_after_forward)"
            )


def _resolve_reshard_after_forward(
    value: bool | int | None, mesh_info: MeshInfo
) -> tuple[bool, MeshInfo | None]:
    """``(reshard?, post-forward mesh)``; an int ``k`` reshards to groups of ``k`` ranks."""
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
    """Depth-first from the roots, not entering modules another call already sharded.

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
        managed.append(m)
        for child in m.children():
            if state_of(child) is None:
                visit(child)

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
    paths = _module_paths(roots)
    sharded = []
    for param, refs in unique_params(triples):
        prefix = paths[id(refs[0].module)]
        name = f"{prefix}.{refs[0].name}" if prefix else refs[0].name
        shard_dim = _shard_dim(shard_placement_fn, param, name, type(refs[0].module).__name__)
        sharded_param = ShardedParam(
            param,
            refs,
            mesh_info,
            device,
            shard_dim,
            name=name,
            offload=offload,
            pin_memory=pin_memory,
            param_dtype_override=param_dtype_override(mp_policy, param),
        )
        sharded.append(sharded_param)
    # Register the sharded parameters only once every parameter passed its checks, so an
    # error leaves the module as it was.
    for sharded_param in sharded:
        for ref in sharded_param.refs:
            ref.set(sharded_param.sharded_param)
    return sharded


def _module_paths(roots: tuple[nn.Module, ...]) -> dict[int, str]:
    """Each module's path under the module(s) given to ``fully_shard``, for messages."""
    paths: dict[int, str] = {}
    for root in roots:
        for path, module in root.named_modules():
            paths.setdefault(id(module), path)
    return paths


class ShardDimError(ValueError, AssertionError):
    """A ``Shard`` dim the parameter does not have. A bad argument, so a ``ValueError``; and
    an ``AssertionError`` too, which torch's ``fully_shard`` raises for it, so code written
    against either type catches it."""


def _shard_dim(shard_placement_fn, param: nn.Parameter, name: str, owner: str) -> int:
    """The tensor dim to shard ``param`` on: 0, or what ``shard_placement_fn`` returns.

    A negative dim counts from the end, once (``Shard(-1)`` of a 2-D weight is dim 1);
    anything still outside ``[0, param.dim())`` is refused rather than wrapped around.
    """
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"Invalid shard_placement_fn result: {placement!r} for parameter {name!r} "
            f"({owner}); shard_placement_fn must return None or a Shard placement"
        )
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        raise ShardDimError(
            f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: "
            f"shard_placement_fn returned Shard({placement.dim}) for parameter {name!r} "
            f"({owner}) of size {tuple(param.size())}, whose dims are {-param.dim()} to "
            f"{param.dim() - 1}"
        )
    return dim


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
