"""Device meshes with the dimension names tests use, over the default process group.

FSDP reads the data-parallel dimensions by name, so every helper names its dimensions:

=============  ===============================================
helper         dimension names (outermost first)
=============  ===============================================
``mesh_1d``    ``("dp_shard",)``
``mesh_hsdp``  ``("dp_replicate", "dp_shard")``
``mesh_dp_tp`` ``("dp_shard", "tp")``
``mesh_nd``    ``("dp_replicate", "dp_shard", "tp")``
=============  ===============================================

Ranks fill the mesh in row-major order. On 8 ranks, ``mesh_nd(2, 2, 2)`` puts ranks
``{0, 1}`` in one ``tp`` group, ``{0, 2}`` in one ``dp_shard`` group and ``{0, 4}`` in one
``dp_replicate`` group.

``device_type`` defaults to the device the test suite runs on (``--device``).
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .common import device_type_under_test


def mesh_1d(device_type: str | None = None) -> DeviceMesh:
    """One dimension, ``"dp_shard"``, spanning every rank: plain FSDP."""
    return _named_mesh({"dp_shard": _world_size()}, device_type)


def mesh_hsdp(replicate: int, shard: int, device_type: str | None = None) -> DeviceMesh:
    """HSDP: ``replicate`` groups of ``shard`` ranks; ``replicate * shard`` is the world."""
    return _named_mesh({"dp_replicate": replicate, "dp_shard": shard}, device_type)


def mesh_dp_tp(shard: int, tp: int, device_type: str | None = None) -> DeviceMesh:
    """FSDP over ``shard`` ranks times tensor parallelism over ``tp`` neighbouring ranks."""
    return _named_mesh({"dp_shard": shard, "tp": tp}, device_type)


def mesh_nd(replicate: int, shard: int, tp: int, device_type: str | None = None) -> DeviceMesh:
    """HSDP (``replicate x shard``) times tensor parallelism over ``tp`` neighbouring ranks.

    Always three dimensions, even when one has size 1; use :func:`mesh_dp_tp` for the
    two-dimensional FSDP + TP mesh.
    """
    return _named_mesh({"dp_replicate": replicate, "dp_shard": shard, "tp": tp}, device_type)


def _world_size() -> int:
    if not dist.is_initialized():
        raise RuntimeError(
            "building a device mesh needs the default process group; call "
            "dist.init_process_group first (the test harnesses do)"
        )
    return dist.get_world_size()


def _named_mesh(sizes: dict[str, int], device_type: str | None) -> DeviceMesh:
    """``init_device_mesh`` with the shape and names of ``sizes``, after checking the shape."""
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh dimension {name!r} must be a positive int, got {size!r}")
    world_size = _world_size()
    shape = tuple(sizes.values())
    product = math.prod(shape)
    if product != world_size:
        described = " x ".join(f"{name}={size}" for name, size in sizes.items())
        raise ValueError(
            f"mesh {described} holds {product} ranks but the world size is {world_size}; "
            "pick sizes whose product is the world size"
        )
    return init_device_mesh(
        device_type or device_type_under_test(), shape, mesh_dim_names=tuple(sizes)
    )
