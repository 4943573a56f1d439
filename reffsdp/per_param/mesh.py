"""Building a parameter group's :class:`~reffsdp.core.mesh.MeshInfo` from ``fully_shard``'s
``mesh`` argument, and sharding parameters that already live on a tensor-parallel or SPMD mesh.

* FSDP (1D mesh): one dim, the shard dim.
* HSDP (2D mesh): dim 0 replicates, dim 1 shards.
* SPMD mesh (``dp_mesh_dims``): the data-parallel dims are named dims of the mesh the
  parameters already live on (next to TP, CP, ... dims); see [Note: SPMD meshes].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ..core import torch_internals
from ..core.mesh import MeshInfo


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    """Interpret a user's mesh: 1D means FSDP, 2D means HSDP ``(replicate, shard)``."""
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_mesh_dim=0)
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise AssertionError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified, e.g. "
                "init_device_mesh(..., mesh_dim_names=('replicate', 'shard')); the mesh "
                f"given, {mesh}, has none"
            )
        return MeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}, a {mesh.ndim}D mesh of shape "
        f"{tuple(mesh.shape)}: 1D shards (FSDP), 2D replicates and shards (HSDP); for more "
        "dims, name the data-parallel ones with dp_mesh_dims"
    )


def device_for(mesh: DeviceMesh) -> torch.device:
    """The compute device on this rank for ``mesh``: CPU, or the current accelerator."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def default_mesh() -> DeviceMesh:
    """A 1D mesh over the default process group, initializing it if needed."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group()
    accelerator = torch.accelerator.current_accelerator()
    backend = dist.get_backend()
    device_type = "cpu"
    if accelerator is not None and torch.accelerator.is_available() and backend != "gloo":
        device_type = accelerator.type
    return init_device_mesh(device_type, (dist.get_world_size(),))


@dataclass(frozen=True)
class TensorParallelSpec:
    """How a parameter was distributed before FSDP saw it (tensor or expert parallel).

    FSDP then shards the *local* tensor-parallel shard over the data-parallel mesh; the
    unsharded parameter it computes with is again a DTensor with exactly this spec.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]


# [Note: strided sharding]
# When tensor parallelism already shards dim ``d`` and FSDP shards the local TP shard on
# ``d`` again, the DP placement comes first in the placements but is applied second. A
# plain ``Shard(d)`` would describe the opposite order, so the DP placement becomes
# ``_StridedShard(d, split_factor=<TP shards on d>)``. With dp = tp = 2 and 8 rows:
# TP rank t holds rows ``4t .. 4t+3``; DP rank p holds rows ``4t + 2p, 4t + 2p + 1`` of
# those, which is what ``(_StridedShard(0, split_factor=2), Shard(0))`` means.


def sharded_spec(
    mesh_info: MeshInfo, shard_dim: int, tp: TensorParallelSpec | None
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """Mesh and placements of a sharded parameter: data-parallel dims, then TP dims (on an
    SPMD mesh, the parameter's own mesh and dims; see [Note: SPMD meshes]).

    See [Note: strided sharding].
    """
    if mesh_info.spmd is not None:
        assert tp is not None, "SpmdDims.check_param admits only DTensor parameters"
        return mesh_info.spmd.mesh, mesh_info.spmd.sharded_placements(shard_dim, tp.placements)
    if tp is None:
        return mesh_info.mesh, mesh_info.placements(Shard(shard_dim))
    if tp.mesh.device_type != mesh_info.device_type:
        raise ValueError(
            f"parameter DTensor lives on a {tp.mesh.device_type} mesh but fully_shard's mesh "
            f"is {mesh_info.device_type}"
        )
    if len(tp.placements) > 2:
        raise NotImplementedError(
            f"fully_shard supports at most 2 tensor/expert-parallel mesh dims, got {tp.placements}"
        )
    tp_shards = 1
    for dim, placement in enumerate(tp.placements):
        if isinstance(placement, Shard) and placement.dim == shard_dim:
            tp_shards *= tp.mesh.size(dim)
    dp_placement: Placement = Shard(shard_dim)
    if tp_shards > 1:
        dp_placement = torch_internals.strided_shard(shard_dim, split_factor=tp_shards)
    mesh = concatenate_meshes(mesh_info.mesh, tp.mesh)
    return mesh, (*mesh_info.placements(dp_placement), *tp.placements)


# -- SPMD meshes (dp_mesh_dims) ------------------------------------------------------------
#
# [Note: SPMD meshes]
# With ``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=...)`` the parameters are already
# DTensors on ``spmd_mesh`` (say ``("dp_replicate", "dp_shard", "tp")``), replicated on the
# dims named as data parallel. This is the tensor-parallel path of ``sharded_spec`` with the
# data-parallel groups taken from the parameters' own mesh instead of a second mesh:
#
# * Groups. The shard names become one shard group and the replicate names one replicate
#   group; several names for one role are flattened into one dim (ranks in row-major order,
#   so names must be listed in mesh order). Shard only is FSDP; replicate only keeps whole
#   parameters (shard size 1) and all-reduces gradients, like DDP; both is HSDP.
# * Sharded parameter. It stays on ``spmd_mesh``: each DP shard dim gets ``Shard(d)`` (or
#   ``_StridedShard`` when non-DP dims to its right also shard ``d``, see [Note: strided
#   sharding]), replicate dims stay ``Replicate()`` and every other dim is unchanged. The
#   unsharded parameter is a DTensor with the original placements.
# * Several shard dims. FSDP chunks the local tensor once, by the flattened rank; one
#   placement per dim instead describes nested chunking (dim ``a``, then ``b`` inside it).
#   Both agree only when the sizes divide evenly: 5 rows on a 2 x 2 shard mesh are chunked
#   2, 2, 1, 0 flat but 2, 1, 1, 1 nested. Uneven cases raise ``NotImplementedError`` rather
#   than produce wrong metadata.
# * The same mesh object. As in torch, every parameter must be a DTensor on the very mesh
#   object passed to ``fully_shard``; an equal mesh built again is refused. Build the
#   parameters and call ``fully_shard`` with one mesh object: a DTensor wrapped in
#   ``nn.Parameter`` (a ``detach``) may even come back on an earlier equal mesh, which
#   DTensor's sharding cache hands out for every equal one.
# * Gradients. The unsharded gradient is redistributed to the parameter's placements on
#   non-DP dims only. A ``Partial`` on a DP dim (e.g. from a batch-sharded DTensor input) is
#   left as is: its local tensor is exactly what FSDP's reduce-scatter / all-reduce reduce,
#   with FSDP's usual divide factor.


@dataclass(frozen=True)
class SpmdDims:
    """The data-parallel dims of a full SPMD mesh, as indices in mesh order."""

    mesh: DeviceMesh
    shard_dims: tuple[int, ...]
    replicate_dims: tuple[int, ...]

    @property
    def dp_dims(self) -> frozenset[int]:
        return frozenset(self.shard_dims + self.replicate_dims)

    def check_param(self, param: torch.Tensor, shard_dim: int, name: str) -> None:
        """Refuse a parameter FSDP cannot shard on this mesh (see [Note: SPMD meshes])."""
        if not isinstance(param, DTensor):
            raise ValueError(
                "with dp_mesh_dims, parameters must be DTensors on the mesh passed to "
                f"fully_shard, but {name} is a plain tensor; distribute it first (e.g. "
                "distribute_tensor(param, mesh, [Replicate(), ...]))"
            )
        if param.device_mesh is not self.mesh:
            # The same object, as torch asks: an equal mesh built again is not enough.
            another = (
                " (an equal mesh, but another object)" if param.device_mesh == self.mesh else ""
            )
            raise ValueError(
                "Expected param's DTensor mesh to be the same mesh passed to fully_shard: "
                f"{name} is a DTensor on {param.device_mesh}{another}, not on the mesh passed "
                f"to fully_shard with dp_mesh_dims ({self.mesh}); distribute the parameters on "
                "the mesh object you pass"
            )
        names = self.mesh.mesh_dim_names
        assert names is not None
        for dim in sorted(self.dp_dims):
            if not isinstance(param.placements[dim], Replicate):
                raise ValueError(
                    f"Expected Replicate() placement of {name} on data-parallel mesh dim "
                    f"{names[dim]!r}, got {param.placements[dim]}: fully_shard shards it there "
                    "itself"
                )
        if len(self.shard_dims) > 1:
            pieces = self._non_dp_shards(param.placements, shard_dim, after=-1)
            pieces *= math.prod(self.mesh.size(dim) for dim in self.shard_dims)
            if param.size(shard_dim) % pieces != 0:
                raise NotImplementedError(
                    f"{name}: sharding over several mesh dims "
                    f"{tuple(names[d] for d in self.shard_dims)} needs tensor dim {shard_dim} "
                    f"(size {param.size(shard_dim)}) to split evenly into {pieces} pieces "
                    "(see [Note: SPMD meshes] in reffsdp/per_param/mesh.py)"
                )

    def sharded_placements(
        self, shard_dim: int, placements: tuple[Placement, ...]
    ) -> tuple[Placement, ...]:
        """The unsharded ``placements`` with FSDP's sharding of ``shard_dim`` on the shard dims.

        With mesh ``(dp_shard, tp)``, a colwise weight ``(Replicate(), Shard(0))`` becomes
        ``(_StridedShard(0, split_factor=2), Shard(0))`` for tp = 2; a rowwise weight
        ``(Replicate(), Shard(1))`` becomes ``(Shard(0), Shard(1))``.
        """
        result = list(placements)
        for dim in self.shard_dims:
            split = self._non_dp_shards(placements, shard_dim, after=dim)
            result[dim] = (
                torch_internals.strided_shard(shard_dim, split_factor=split)
                if split > 1
                else Shard(shard_dim)
            )
        return tuple(result)

    def grad_placements(
        self, grad: tuple[Placement, ...], param: tuple[Placement, ...]
    ) -> tuple[Placement, ...]:
        """Where to redistribute an unsharded gradient: the parameter's placements, except
        that DP dims keep a ``Partial`` for FSDP to reduce (see [Note: SPMD meshes])."""
        return tuple(
            grad[dim] if dim in self.dp_dims and isinstance(grad[dim], Partial) else placement
            for dim, placement in enumerate(param)
        )

    def _non_dp_shards(self, placements: tuple[Placement, ...], tensor_dim: int, after: int):
        """Pieces that non-DP mesh dims after mesh dim ``after`` cut ``tensor_dim`` into."""
        pieces = 1
        for dim in range(after + 1, self.mesh.ndim):
            placement = placements[dim]
            if dim in self.dp_dims or not torch_internals.cuts_a_dim(placement):
                continue
            if placement.dim == tensor_dim:
                pieces *= self.mesh.size(dim)
        return pieces


class DpMeshDimsError(ValueError, RuntimeError):
    """``dp_mesh_dims`` naming no mesh dim, or one dim twice. A bad argument, so a
    ``ValueError``; torch's ``fully_shard`` fails on it inside ``DeviceMesh`` (slicing,
    flattening or concatenating the named dims) with a ``RuntimeError``, so it is one too."""


class DpMeshDimsOrderError(ValueError, KeyError):
    """``dp_mesh_dims`` naming dims out of mesh order: a ``ValueError``, and the ``KeyError``
    that ``DeviceMesh`` slicing raises for it in torch's ``fully_shard``."""

    __str__ = Exception.__str__  # the message as written, not quoted as a KeyError's key


def spmd_mesh_info(
    mesh: DeviceMesh, shard_names: tuple[str, ...], replicate_names: tuple[str, ...]
) -> MeshInfo:
    """Interpret ``dp_mesh_dims`` on a full SPMD mesh (see [Note: SPMD meshes]).

    Checked in torch's order: the mesh has dim names, every name is one of them, some dim
    is named, each role's names are distinct and in mesh order, no dim has both roles.
    """
    if mesh.mesh_dim_names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided: dp_mesh_dims names "
            "mesh dims, but the mesh has no dim names; create it with "
            "init_device_mesh(..., mesh_dim_names=...)"
        )
    _check_known_names(mesh.mesh_dim_names, shard_names + replicate_names)
    if not shard_names and not replicate_names:
        raise DpMeshDimsError(
            "dp_mesh_dims names no mesh dim (empty shard and replicate names): name at least "
            "one dim that data parallelism shards or replicates over"
        )
    spmd = SpmdDims(
        mesh,
        _dim_indices(mesh, shard_names, "shard"),
        _dim_indices(mesh, replicate_names, "replicate"),
    )
    both = set(shard_names) & set(replicate_names)
    if both:
        raise DpMeshDimsError(
            f"mesh dims {sorted(both)} cannot both shard and replicate: the shard and "
            "replicate meshes would be overlapping"
        )
    if not shard_names:
        return MeshInfo(flatten_dims(mesh, replicate_names), None, 0, spmd=spmd)
    shard_mesh = flatten_dims(mesh, shard_names)
    if not replicate_names:
        return MeshInfo(shard_mesh, 0, spmd=spmd)
    # One (replicate, shard) mesh, as a user's HSDP mesh; both slice the same root mesh.
    hsdp_mesh = concatenate_meshes(flatten_dims(mesh, replicate_names), shard_mesh)
    return MeshInfo(hsdp_mesh, 1, 0, spmd=spmd)


def _check_known_names(mesh_names: tuple[str, ...], names: tuple[str, ...]) -> None:
    unknown = [name for name in names if name not in mesh_names]
    if unknown:
        raise ValueError(
            f"Mesh dim name {unknown[0]!r} not found in mesh.mesh_dim_names {mesh_names}: "
            f"dp_mesh_dims names {unknown}, which are not dims of the mesh the parameters "
            "live on"
        )


def _dim_indices(mesh: DeviceMesh, names: tuple[str, ...], role: str) -> tuple[int, ...]:
    mesh_names = mesh.mesh_dim_names
    assert mesh_names is not None
    dims = tuple(mesh_names.index(name) for name in names)
    if len(set(dims)) != len(dims):
        raise DpMeshDimsError(
            f"dp_mesh_dims {role} names {names} name a mesh dim more than once, which would "
            "slice overlapping dims; list each dim once"
        )
    if list(dims) != sorted(dims):
        raise DpMeshDimsOrderError(
            f"dp_mesh_dims {role} names {names} must be in mesh order {mesh_names}: Mesh dim "
            "indices should be in ascending order"
        )
    return dims


def flatten_dims(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """A 1D mesh over the named dims of ``mesh``, ranks in row-major order."""
    if len(names) == 1:
        return mesh[names[0]]
    # Built once, then cached by name: the 1D mesh and its process group over exactly
    # these ranks.
    return torch_internals.flatten_mesh(mesh[names], "_".join(names))


def concatenate_meshes(first: DeviceMesh, second: DeviceMesh) -> DeviceMesh:
    """One mesh whose dims are ``first``'s then ``second``'s (both slices of one root mesh)."""
    return torch_internals.concatenate_meshes([first, second])
