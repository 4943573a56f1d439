"""Which process groups a parameter group talks to: the mesh seen from data parallelism.

* FSDP (1D mesh): one dim, the shard dim. All-gather and reduce-scatter run over it.
* HSDP (2D mesh): dim 0 replicates, dim 1 shards. All-gather and reduce-scatter run over
  the shard dim's group, then gradients are all-reduced over the replicate dim's group.
* SPMD mesh: the data-parallel dims are some of the dims of the mesh the parameters
  already live on (``spmd`` says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard


@dataclass
class MeshInfo:
    """A data-parallel mesh and the groups, sizes and ranks FSDP uses on it."""

    mesh: DeviceMesh
    shard_mesh_dim: int | None
    replicate_mesh_dim: int | None = None
    # When the parameters already live on a larger mesh (data-parallel dims next to TP, CP,
    # ... dims): the front end's record of that mesh. The core carries it and never reads it.
    spmd: Any = None
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
    def has_replicate_group(self) -> bool:
        """Whether reduced gradients are all-reduced across replicas (HSDP, or replicate only)."""
        return self.replicate_group is not None

    @property
    def device_type(self) -> str:
        return self.mesh.device_type

    def placements(self, shard: Shard) -> tuple[Placement, ...]:
        """Placements of a parameter sharded with ``shard`` on this mesh."""
        if self.is_hsdp:
            return (Replicate(), shard)
        return (shard,)
