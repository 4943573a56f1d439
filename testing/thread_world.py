"""A per-thread c10d world, so that one thread per rank can each call ``init_process_group``.

c10d keeps its process groups in one module-level object, its private ``_World``: the
default group, the group-to-name and group-to-ranks maps, the group counter used to name new
groups, and a few more. Within one process that state is shared, so a second thread calling
``init_process_group`` would see "already initialized". :class:`ThreadLocalWorld` answers the
same attribute names from state that belongs to the calling thread, and :func:`threaded_world`
installs it for the length of a ``with`` block.

The other process-wide switches a threaded run needs are set by the same context manager and
restored on exit:

* c10d's C++ group-name registry (which functional collectives use to find a group by name)
  becomes thread-local through ``_set_thread_isolation_mode(True)``;
* DTensor's sharding propagation traces ops under a fake-tensor mode, which two threads must
  not do at once: that step is serialized (entry H1 of [Note: torch versions of the
  harness] in ``reffsdp.testing.torch_private``, for how on each torch);
* torch 2.15's flight recorder, which cannot record a group implemented in Python, is kept
  off the threaded groups (entry H2 there);
* ``init_process_group`` writes two module globals (the backend name and init method) and
  wraps ``sys.excepthook`` with a rank prefix, from every rank thread; DTensor's random
  ops create a module-level RNG tracker bound to a rank's mesh. All are put back.

What each *rank thread* must do for itself is :func:`prepare_rank_thread`: autograd's
"multithreading" flag is thread-local, and when it is on, backward may run device work on
autograd's own worker threads, where the rank's thread-local world does not exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from reffsdp.testing import torch_private


@dataclasses.dataclass
class _WorldState:
    """One thread's copy of what c10d's ``_World`` holds."""

    default_pg: dist.ProcessGroup | None = None
    pg_map: dict = dataclasses.field(default_factory=dict)
    pg_names: dict = dataclasses.field(default_factory=dict)
    pg_group_ranks: dict = dataclasses.field(default_factory=dict)
    pg_backend_config: dict = dataclasses.field(default_factory=dict)
    group_count: int = 0
    tags_to_pg: dict = dataclasses.field(default_factory=dict)
    pg_to_tag: dict = dataclasses.field(default_factory=dict)
    pg_coalesce_state: dict = dataclasses.field(default_factory=dict)
    pg_flight_recorder_hooks: dict = dataclasses.field(default_factory=dict)  # torch 2.15+
    comms: list = dataclasses.field(default_factory=list)


def _per_thread(name: str, *, settable: bool = False) -> property:
    """A property that reads (and optionally writes) field ``name`` of the caller's state."""

    def getter(self: ThreadLocalWorld) -> Any:
        return getattr(self._state(), name)

    def setter(self: ThreadLocalWorld, value: Any) -> None:
        setattr(self._state(), name, value)

    return property(getter, setter if settable else None, doc=f"This thread's ``{name}``.")


class ThreadLocalWorld(torch_private.C10D_WORLD_BASE):
    """c10d's ``_World`` with every field kept per thread.

    It subclasses ``_World`` so that anything torch derives from those fields (such as
    ``pg_config_info``) keeps working; every field c10d reads is overridden below. A fresh
    instance starts every thread empty, so installing a new one per test also discards
    whatever a previous test's threads left behind.
    """

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def _state(self) -> _WorldState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _WorldState()
        return state

    default_pg = _per_thread("default_pg", settable=True)
    pg_map = _per_thread("pg_map")
    pg_names = _per_thread("pg_names")
    pg_group_ranks = _per_thread("pg_group_ranks")
    pg_backend_config = _per_thread("pg_backend_config")
    group_count = _per_thread("group_count", settable=True)
    tags_to_pg = _per_thread("tags_to_pg")
    pg_to_tag = _per_thread("pg_to_tag")
    pg_coalesce_state = _per_thread("pg_coalesce_state")
    pg_flight_recorder_hooks = _per_thread("pg_flight_recorder_hooks")
    comms = _per_thread("comms")


@contextlib.contextmanager
def _restored(owner: Any, *names: str) -> Iterator[None]:
    """Put ``owner``'s attributes ``names`` back to their current values on exit."""
    saved = {name: getattr(owner, name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def threaded_world() -> Iterator[ThreadLocalWorld]:
    """Make c10d state per thread for the ``with`` block; restore everything on exit.

    The calling (main) thread keeps seeing an uninitialized world inside the block. Nesting
    is refused: two overlapping threaded runs in one process would share the C++ isolation
    switch and could not restore each other's state.
    """
    if isinstance(torch_private.c10d_world(), ThreadLocalWorld):
        raise RuntimeError("a threaded world is already installed; threaded runs cannot nest")
    from reffsdp.testing.threaded_pg import BACKEND_NAME

    world = ThreadLocalWorld()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_restored(sys, "excepthook"))
        stack.enter_context(torch_private.dtensor_rng_tracker_restored())
        stack.enter_context(torch_private.serialized_sharding_propagation())
        stack.enter_context(torch_private.no_flight_recorder_for(BACKEND_NAME))
        stack.enter_context(torch_private.c10d_world_installed(world))
        yield world


def prepare_rank_thread() -> None:
    """Per-thread setup a rank thread needs before it runs any forward or backward.

    Autograd's multithreading flag is thread-local. Turning it off makes the backward pass
    (and with it DDP's reducer and FSDP's post-backward hooks) run on the rank's own thread,
    where ``dist.get_rank()`` and the rank's groups resolve. The thread ends with the rank,
    so nothing is restored.
    """
    torch.autograd.set_multithreading_enabled(False)


# [Note: a rank thread's DTensor cache]
# DTensor's C++ dispatch fast path keeps a sharding cache per thread and frees it when the
# thread ends, under one process-wide C++ mutex, freeing Python objects as it goes, which
# lets go of the GIL. Two rank threads ending together can deadlock there: one holds the
# mutex and waits for the GIL, the other holds the GIL (ending its thread) and waits for the
# mutex. Seen once on torch 2.11 (test_fully_shard_training hung in a clean-clone CI run);
# every supported release has the same code. So each rank thread frees its cache itself as
# its last step, one thread at a time: a thread waiting for its turn waits on a Python lock,
# which lets go of the GIL, and a thread that ends has no cache left to free.
_FREEING_DTENSOR_CACHE = threading.Lock()


def release_rank_thread() -> None:
    """A rank thread's last step: free its DTensor cache, one thread at a time (see
    [Note: a rank thread's DTensor cache])."""
    with _FREEING_DTENSOR_CACHE:
        torch_private.free_dtensor_thread_cache()
