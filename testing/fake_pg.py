"""A fake process group: simulate one rank of a large world inside one process.

Use it to test shapes, sharding and collective counts at world sizes no machine could spawn
(64, 1024, a (8, 128) mesh), with no other process to talk to::

    with fake_process_group(world_size=1024, rank=3):
        mesh = init_device_mesh("cpu", (8, 128))
        ...

[Note: fake collectives]
The group is torch's C++ ``FakeProcessGroup``. Every collective completes at once and moves
no data between ranks; it only writes this rank's output buffer, so shapes and dtypes are
exactly those of a real run and the numbers are meaningless:

* all-gather copies the local input into every rank's slot of the output;
* reduce-scatter copies this rank's chunk of the input into the output (no reduction) on
  torch 2.13 and newer, and leaves the output as it was before (entry H3 of [Note: torch
  versions of the harness] in ``reffsdp.testing.torch_private``);
* all-reduce and broadcast leave the tensor as it is.

Its collectives go through the dispatcher like gloo's and NCCL's, so
:class:`~reffsdp.testing.comm_counter.CommCounter` counts them.

[Note: registering the backend]
``dist.Backend`` knows the name ``"fake"`` (from torch 2.11 on), but the factory that builds
the group is registered only when torch's internal testing module for it is imported,
which reffsdp does not do. :func:`register_fake_backend` registers our own factory
over the C++ class when nobody has registered one yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from reffsdp.core import comms

from . import torch_private

FAKE_BACKEND = "fake"


class FakeStore(dist.Store):
    """A key-value store that holds nothing.

    ``init_process_group`` insists on a store, but the fake group never exchanges anything
    through it, so an empty one is enough.
    """


def _create_fake_backend(common_options: Any, backend_options: Any) -> Any:
    """The factory ``init_process_group("fake", ...)`` calls to build the C++ group."""
    fake_class = torch_private.fake_process_group_class()
    rank, size = common_options.group_rank, common_options.group_size
    create = getattr(fake_class, "_create_internal", None)
    if create is None:
        # Older builds construct the group directly and take no options.
        return fake_class(rank, size)
    if backend_options is None:
        return create(rank, size)
    return create(rank, size, backend_options)


def register_fake_backend() -> None:
    """Make ``"fake"`` a usable backend name; a no-op when a factory is already registered."""
    # Its collectives compute nothing, so it takes every reduce op a real run would use.
    comms.register_reduce_ops(FAKE_BACKEND, [dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM])
    if torch_private.registered_backend_creator(FAKE_BACKEND) is not None:
        return
    # Fail here, with a clear message, not at group creation.
    torch_private.fake_process_group_class()
    dist.Backend.register_backend(
        FAKE_BACKEND,
        _create_fake_backend,
        extended_api=True,
        devices=["cpu", "cuda", "hpu", "xpu"],
    )


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Make the default group a fake group of ``world_size`` in which we are ``rank``.

    The group is destroyed on exit, with every subgroup (device-mesh dimensions included).
    See [Note: fake collectives] for what its collectives do.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group is already initialized; destroy it before entering "
            "fake_process_group"
        )
    register_fake_backend()
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
