"""``fully_shard``: shard a module's parameters and install the FSDP hooks.

Apply it bottom-up: to each block first, then to the model. Each call claims the
parameters of its module(s) that no earlier call claimed, so a block's parameters belong
to the block's group and the rest (embeddings, final norm, ...) to the root's group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, overload

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ..core.mesh import MeshInfo, default_mesh, device_for, mesh_info_for, spmd_mesh_info
from ..core.param_group import GroupSettings, ParamGroup
from ..core.sharded_param import ShardedParam, unique_params
from .api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .module import FSDPModule
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
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    _check_modules(modules)
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
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"offload_policy must be an OffloadPolicy, got {offload_policy!r}")
    sharded = _shard_params(managed, ignored, mesh_info, device, shard_placement_fn, offload_policy)
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
    for m in managed:
        m._is_fsdp_managed_module = True  # type: ignore[attr-defined]
        m._fsdp_use_orig_params = True  # type: ignore[attr-defined]
    return module


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward in (
            nn.ModuleList.forward,
            nn.ModuleDict.forward,
        ):
            raise ValueError(
                f"fully_shard does not support {type(m).__name__} containers, which have no "
                "forward; shard each child or the module that calls them"
            )
        if state_of(m) is not None:
            raise AssertionError(f"fully_shard was already applied to {type(m).__name__}")


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
            f"reshard_after_forward={value}: an int is not supported with dp_mesh_dims; "
            "pass True or False"
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
        if getattr(m, "_is_fsdp_managed_module", False):
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
    managed, ignored, mesh_info, device, shard_placement_fn, offload_policy
) -> list[ShardedParam]:
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    pin_memory = offload and offload_policy.pin_memory
    triples = [
        (m, name, p)
        for m in managed
        for name, p in m._parameters.items()
        if p is not None and id(p) not in ignored
    ]
    sharded = []
    for param, refs in unique_params(triples):
        placement = shard_placement_fn(param) if shard_placement_fn is not None else None
        if placement is not None and not isinstance(placement, Shard):
            raise ValueError(
                f"shard_placement_fn must return None or a Shard placement, got {placement!r}"
            )
        shard_dim = placement.dim if placement is not None else 0
        sharded_param = ShardedParam(
            param, refs, mesh_info, device, shard_dim, offload=offload, pin_memory=pin_memory
        )
        for ref in refs:
            ref.set(sharded_param.sharded_param)
        sharded.append(sharded_param)
    return sharded


def _move_buffers(managed: list[nn.Module], device: torch.device) -> None:
    for m in managed:
        for name, buffer in m._buffers.items():
            if buffer is not None and buffer.device.type != "meta" and buffer.device != device:
                m._buffers[name] = buffer.to(device)


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    fsdp_cls = _fsdp_classes.get(cls)
    if fsdp_cls is None:

        def __deepcopy__(self, memo):  # noqa: N807
            raise AssertionError("copy.deepcopy of a fully_shard module is not supported")

        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": __deepcopy__})
        _fsdp_classes[cls] = fsdp_cls
    module.__class__ = fsdp_cls


def _state(module: nn.Module) -> FSDPState | None:
    return state_of(module)


fully_shard.state = _state  # type: ignore[attr-defined]
fully_shard.__module__ = "reffsdp"
