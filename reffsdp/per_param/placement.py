"""Where ``shard_placement_fn`` puts a parameter: a tensor dim, and the mesh of its group.

[Note: per-parameter meshes]
``shard_placement_fn(param)`` answers, for each parameter of a ``fully_shard`` call:

* ``None``: shard dim 0 over the mesh given to ``fully_shard``;
* ``Shard(d)``: shard dim ``d`` over that mesh;
* a placement result: shard ``placement`` (``None`` for dim 0, or a ``Shard``) over a mesh of
  the parameter's own, e.g. mixture-of-experts weights over the expert-parallel ranks while
  the rest of the block is sharded over all data-parallel ranks.

A placement result is torch's ``ShardPlacementResult(placement, mesh_info)``, where
``mesh_info`` is torch's ``FSDPMeshInfo(mesh, shard_mesh_dim=0)`` (shard over a 1D mesh) or
``HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)`` (shard over dim 1 of a 2D mesh,
all-reduce over dim 0). Those types are private to ``torch.distributed.fsdp``, which reffsdp
never imports, and torch before 2.12 has none, so reffsdp recognizes a result by its shape:
an object with ``placement`` and ``mesh_info`` attributes, whose ``mesh_info.mesh`` is a
``DeviceMesh`` and whose ``mesh_info`` has an int ``shard_mesh_dim`` and a
``replicate_mesh_dim`` (``None`` or missing: FSDP; an int: HSDP). It reads those four fields
and nothing else, and builds its own :class:`~reffsdp.core.mesh.MeshInfo` from them; any
object of that shape will do, on every torch. Anything else is refused: not result-shaped,
"Invalid shard_placement_fn result" (torch's words from 2.12); result-shaped but with a
placement that is no ``Shard``, or with a mesh description without a mesh or a shard dim
(torch's ``DDPMeshInfo``), a message saying which. All three are a :class:`ShardPlacementError`,
a ``ValueError`` and the ``AttributeError`` torch raises for most of them. An SPMD
description (``dp_mesh_dims`` set) is a ``NotImplementedError``.

The rules, torch's:

1. One parameter group per mesh. A call's parameters are grouped by the process groups they
   shard and replicate over; groups are ordered as their first parameters. Each group
   all-gathers, reduce-scatters (and for HSDP all-reduces) over its own mesh, and divides
   gradients by its own data-parallel size.
2. One mesh description per pair of process groups: parameters sharded over the same groups
   must name them with the very same ``mesh_info`` object. ``fully_shard``'s own mesh counts
   as one such object, so a result restating that mesh is refused (return ``None`` or a
   ``Shard`` for it instead).
3. ``reshard_after_forward`` applies to each group on its own mesh: an int ``k`` must divide
   every group's shard size, and a group whose shard size is ``k`` reshards fully.
4. Not with ``dp_mesh_dims`` naming replicate dims only (no shard dim to place on): any
   ``shard_placement_fn`` is refused there.
5. A call with several groups runs every hook, prefetch, reduction and state-dict hook for
   each (see [Note: prefetch policy] in ``state``), and every ``FSDPModule`` method covers
   them all, except those that install one communication for the module
   (``set_custom_all_gather``, ``set_custom_reduce_scatter``, ``set_all_reduce_hook``):
   ambiguous across meshes, they refuse a module with several groups (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ..core.mesh import MeshInfo


class ShardDimError(ValueError, AssertionError):
    """A ``Shard`` dim the parameter does not have. A bad argument, so a ``ValueError``; and
    an ``AssertionError`` too, which torch's ``fully_shard`` raises for it, so code written
    against either type catches it."""


class ShardPlacementError(ValueError, AttributeError):
    """A ``shard_placement_fn`` result reffsdp cannot use (see [Note: per-parameter
    meshes]). A bad argument, so a ``ValueError``; torch's ``fully_shard`` fails on such
    results reading a field they lack (a placement's ``dim`` before 2.12, a mesh
    description's process group) with an ``AttributeError``, so it is one too."""


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter is sharded: a dim of it, over a group's mesh."""

    shard_dim: int
    mesh_info: MeshInfo


class GroupMeshes:
    """The meshes of one ``fully_shard`` call's groups (rules 1 and 2), from its own mesh and
    the mesh descriptions that placement results name.

    With ``fully_shard(block, mesh=dp, ...)`` and experts placed by ``ep_info``, a
    ``FSDPMeshInfo`` over an expert-parallel mesh: ``mesh_info_for(ep_info)`` gives the same
    :class:`MeshInfo` for every expert weight, so they form one group; a second
    ``FSDPMeshInfo(ep_mesh, 0)`` object, or one over ``dp``, is refused (rule 2).
    """

    def __init__(self, default: MeshInfo) -> None:
        self.default = default
        # By the process groups a mesh shards and replicates over: (description, mesh info),
        # where the description is the result's ``mesh_info`` (None: fully_shard's mesh).
        self._by_groups: dict[tuple[Any, Any], tuple[Any, MeshInfo]] = {
            _process_groups(default): (None, default)
        }

    def mesh_info_for(self, description: Any) -> MeshInfo:
        """reffsdp's mesh info for a result's ``mesh_info``: one per description (rule 2)."""
        for known, info in self._by_groups.values():
            if known is description:
                return info
        info = _read_mesh_description(description)
        known, _ = self._by_groups.setdefault(_process_groups(info), (description, info))
        if known is not description:
            mesh = "the mesh passed to fully_shard" if known is None else repr(known)
            raise ValueError(
                "Params sharing the same process group must use the same FSDPMeshInfo "
                f"object, but got different objects: {mesh} vs {description!r}; return None or "
                "a Shard for parameters on fully_shard's own mesh, and one mesh_info object "
                "per mesh of your own"
            )
        return info


def resolve_placement(
    result: Any, param: nn.Parameter, meshes: GroupMeshes, name: str, owner: str
) -> ParamPlacement:
    """Where ``param`` goes, from ``shard_placement_fn``'s ``result`` (see [Note: per-parameter
    meshes]); ``name`` and ``owner`` (its module's class) are for messages."""
    if result is None:
        return ParamPlacement(0, meshes.default)
    if isinstance(result, Shard):
        return ParamPlacement(shard_dim(result, param, name, owner), meshes.default)
    if not (hasattr(result, "placement") and hasattr(result, "mesh_info")):
        raise ShardPlacementError(
            f"Invalid shard_placement_fn result: {result!r} for parameter {name!r} ({owner}); "
            "shard_placement_fn must return None, a Shard placement, or a placement result "
            "(torch's ShardPlacementResult(placement, mesh_info))"
        )
    placement = result.placement
    if placement is not None and not isinstance(placement, Shard):
        raise ShardPlacementError(
            f"shard_placement_fn returned the placement {placement!r} for parameter {name!r} "
            f"({owner}); a placement result's placement must be None or a Shard"
        )
    mesh_info = meshes.mesh_info_for(result.mesh_info)
    dim = 0 if placement is None else shard_dim(placement, param, name, owner)
    return ParamPlacement(dim, mesh_info)


def shard_dim(placement: Shard, param: nn.Parameter, name: str, owner: str) -> int:
    """The tensor dim ``placement`` shards ``param`` on.

    A negative dim counts from the end, once (``Shard(-1)`` of a 2-D weight is dim 1);
    anything still outside ``[0, param.dim())`` is refused rather than wrapped around.
    """
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        raise ShardDimError(
            f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: "
            f"shard_placement_fn returned Shard({placement.dim}) for parameter {name!r} "
            f"({owner}) of size {tuple(param.size())}, whose dims are {-param.dim()} to "
            f"{param.dim() - 1}"
        )
    return dim


def check_placement_fn_allowed(
    shard_placement_fn: Callable[[nn.Parameter], Any] | None, mesh_info: MeshInfo
) -> None:
    """Rule 4: no placement function where ``fully_shard`` shards over no mesh dim."""
    if shard_placement_fn is not None and mesh_info.shard_mesh_dim is None:
        raise ValueError(
            "Per-param mesh via shard_placement_fn is not supported with DDPMeshInfo: "
            "dp_mesh_dims names replicate dims only, so there is no shard dim to place "
            "parameters on; drop shard_placement_fn or name a shard dim"
        )


def _read_mesh_description(description: Any) -> MeshInfo:
    """A :class:`MeshInfo` from the four fields reffsdp reads (see [Note: per-parameter
    meshes])."""
    mesh = getattr(description, "mesh", None)
    shard = getattr(description, "shard_mesh_dim", None)
    replicate = getattr(description, "replicate_mesh_dim", None)
    if not isinstance(mesh, DeviceMesh) or not _is_dim(shard) or not _is_dim(replicate, True):
        raise ShardPlacementError(
            f"a placement result's mesh_info must describe a DeviceMesh to shard over, as "
            "torch's FSDPMeshInfo(mesh, shard_mesh_dim=0) or HSDPMeshInfo(mesh, "
            "shard_mesh_dim=1, replicate_mesh_dim=0) do (attributes mesh, shard_mesh_dim and "
            f"replicate_mesh_dim), but got {description!r}"
        )
    if getattr(description, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(
            "reffsdp does not support a per-parameter mesh given with dp_mesh_dims (an SPMD "
            f"mesh description): {description!r}; describe the mesh to shard over directly"
        )
    return MeshInfo(mesh, shard, replicate)


def _is_dim(value: Any, optional: bool = False) -> bool:
    if value is None:
        return optional
    return isinstance(value, int) and not isinstance(value, bool)


def _process_groups(info: MeshInfo) -> tuple[Any, Any]:
    return info.shard_group, info.replicate_group
