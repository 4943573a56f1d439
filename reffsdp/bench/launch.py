"""Start the rank processes (or threads) of one benchmark run and collect their results.

Rank processes come from :mod:`reffsdp.testing.launch`, the one launcher of reffsdp's tests
and measurements (which stops them on Ctrl-C: [Note: stopping rank processes] there). They
are spawned, not forked, with the heap counter in ``LD_PRELOAD`` (see ``memory``), so their
CPU memory is counted process-wide; each sends its results back as JSON.

Under torchrun or srun this process is already one rank of the launched world, and
:func:`~reffsdp.testing.launch.start_ranks` joins it instead of spawning ([Note: two ways to
be a rank] there). No launcher of ours collects the other ranks' results then, so each rank
gathers every rank's before it leaves the group, and every process gets the whole list.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from reffsdp.testing.launch import RankWorld, spawn_ranks, start_ranks

from .memory import build_heap_counter

PG_TIMEOUT = timedelta(minutes=10)


@contextmanager
def heap_counter_preloaded(wanted: bool) -> Iterator[str]:
    """``LD_PRELOAD`` the heap counter into processes started inside the block.

    Yields "" when it is preloaded, otherwise why memory is not measured.
    """
    if not wanted:
        yield ""
        return
    path, why = build_heap_counter()
    if path is None:
        yield why
        return
    previous = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{path} {previous}" if previous else str(path)
    try:
        yield ""
    finally:
        if previous is None:
            del os.environ["LD_PRELOAD"]
        else:
            os.environ["LD_PRELOAD"] = previous


def _process_main(
    world: RankWorld, channel: Connection, backend: str, fn: Callable[..., dict], config: Any
) -> None:
    device = config["options"].device if isinstance(config, dict) else None
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.local_world_size))
    world.init_process_group(backend, PG_TIMEOUT)
    try:
        result = fn(world.rank, world.world_size, config)
        known = {world.rank: result}
        if world.joined:  # no launcher of ours hears the other ranks: gather theirs here
            every: list[Any] = [None] * world.world_size
            dist.all_gather_object(every, result)
            known = dict(enumerate(every))
    finally:
        dist.destroy_process_group()
        # Free what still holds the group (models, hooks: reference cycles), so gloo's
        # worker threads are joined now, not torn down with the interpreter (where torch
        # 2.15's abort with "terminate called without an active exception").
        gc.collect()
    channel.send(json.dumps(sorted(known.items())))


def run_processes(
    fn: Callable[[int, int, Any], dict], world_size: int, backend: str, config: Any
) -> list[dict]:
    """Call ``fn(rank, world_size, config)`` in one process per rank (spawned, or this one
    joining a launched world); every rank's results."""
    args = (backend, fn, config)
    results: dict[int, dict] = {}
    with start_ranks(_process_main, world_size, args, name="bench") as ranks:
        for _, message in ranks.messages():
            results.update((rank, result) for rank, result in json.loads(message))
    return [results[rank] for rank in range(world_size)]


def run_threads(fn: Callable[[int, int, Any], dict], world_size: int, config: Any) -> list[dict]:
    """Call ``fn`` on one thread per rank over reffsdp's threaded process group."""
    from reffsdp.testing.multithread import run_threaded

    results: dict[int, dict] = {}

    def rank_main(rank: int) -> None:
        results[rank] = json.loads(json.dumps(fn(rank, world_size, config)))

    run_threaded(rank_main, world_size, timeout_s=PG_TIMEOUT.total_seconds())
    return [results[rank] for rank in range(world_size)]


def run_single_process(fn: Callable[[Any], dict], config: Any) -> dict:
    """Call ``fn(config)`` in one fresh process (e.g. for the fake process group)."""
    with spawn_ranks(_single_main, 1, (fn, config), name="bench") as ranks:
        ((_, message),) = ranks.messages()
    return json.loads(message)


def _single_main(
    world: RankWorld, channel: Connection, fn: Callable[..., dict], config: Any
) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    channel.send(json.dumps(fn(config)))
