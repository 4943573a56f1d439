"""Which process groups a parameter group talks to: the mesh seen from data parallelism.

* FSDP (1D mesh): one dim, the shard dim. All-gather and reduce-scatter run over it.
* HSDP (2D mesh): dim 0 replicates, dim 1 shards. All-gather and reduce-scatter run over
  the shard dim's group, then gradients are all-reduced over the replicate dim's group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


@dataclass
class MeshInfo:
    """A data-parallel mesh and the groups, sizes and ranks FSDP uses on it."""

    mesh: DeviceMesh
    shard_mesh_dim: int | None
    replicate_mesh_dim: int | None = None
    shard_group: dist.ProcessGroup | None = field(init=False, default=None)
    shard_size: int = field(init=False, default=1)
    shard_rank: int = field(init=False, default=0)
    replicate_group: dist.ProcessGroup | None = field(init=False, default=None)
    replicate_size: int = field(init=False, default=1)
    replicate_rank: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.shard_mesh_dim is not None:
            self.shard_group = self.mesh.get_group(self.shard_mesh_dim)
            self.shard_size = self.mesh.size(self.shard_mesh_dim)
            self.shard_rank = self.mesh.get_local_rank(self.shard_mesh_dim)
        if self.replicate_mesh_dim is not None:
            self.replicate_group = self.mesh.get_group(self.replicate_mesh_dim)
            self.replicate_size = self.mesh.size(self.replicate_mesh_dim)
            self.replicate_rank = self.mesh.get_local_rank(self.replicate_mesh_dim)

    @property
    def is_hsdp(self) -> bool:
        return self.shard_mesh_dim is not None and self.replicate_mesh_dim is not None

    @property
    def device_type(self) -> str:
        return self.mesh.device_type

    def placements(self, shard: Shard) -> tuple[Placement, ...]:
        """Placements of a parameter sharded with ``shard`` on this mesh."""
        if self.is_hsdp:
            return (Replicate(), shard)
        return (shard,)


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    """Interpret a user's mesh: 1D means FSDP, 2D means HSDP ``(replicate, shard)``."""
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_mesh_dim=0)
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise AssertionError(
                "a 2D mesh for HSDP needs dim names, e.g. "
                "init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
            )
        return MeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    raise ValueError(f"fully_shard expects a 1D (FSDP) or 2D (HSDP) mesh, got {mesh.ndim}D")


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


def sharded_spec(
    mesh_info: MeshInfo, shard_dim: int, tp: TensorParallelSpec | None
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """Mesh and placements of a sharded parameter: data-parallel dims, then TP dims.

    [Note: strided sharding]
    When tensor parallelism already shards dim ``d`` and FSDP shards the local TP shard on
    ``d`` again, the DP placement comes first in the placements but is applied second. A
    plain ``Shard(d)`` would describe the opposite order, so the DP placement becomes
    ``_StridedShard(d, split_factor=<TP shards on d>)``. With dp = tp = 2 and 8 rows:
    TP rank t holds rows ``4t .. 4t+3``; DP rank p holds rows ``4t + 2p, 4t + 2p + 1`` of
    those, which is what ``(_StridedShard(0, split_factor=2), Shard(0))`` means.
    """
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
        dp_placement = _StridedShard(shard_dim, split_factor=tp_shards)
    # Both meshes slice one root mesh; DeviceMesh has no public way to join them yet.
    mesh = DeviceMesh._concatenate([mesh_info.mesh, tp.mesh])
    return mesh, (*mesh_info.placements(dp_placement), *tp.placements)
