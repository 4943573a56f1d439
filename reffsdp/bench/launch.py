"""Start the rank processes (or threads) of one benchmark run and collect their results.

Rank processes are started with the heap counter in ``LD_PRELOAD`` (see ``memory``), so
their CPU memory is counted process-wide; each writes its results as JSON into a temporary
directory, which the launching process reads back.

[Note: stopping the benchmark's processes]
Ctrl-C reaches the launching process, and with it (a signal to the process group) every
rank process. Rank processes start with SIGINT ignored and end at once, silently, when it
arrives later; the launching process, interrupted or not, terminates and joins them before
it returns (:func:`_stop`), so no rank outlives the run.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    rank: int, world_size: int, backend: str, out_dir: str, fn: Callable[..., dict], config: Any
) -> None:
    _end_quietly_on_sigint()
    device = config["options"].device if isinstance(config, dict) else None
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.FileStore(os.path.join(out_dir, "store"), world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=PG_TIMEOUT
    )
    try:
        result = fn(rank, world_size, config)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)


def run_processes(
    fn: Callable[[int, int, Any], dict], world_size: int, backend: str, config: Any
) -> list[dict]:
    """Call ``fn(rank, world_size, config)`` in one process per rank; their results."""
    with tempfile.TemporaryDirectory(prefix="reffsdp-bench-") as out_dir:
        _start_and_join(_process_main, (world_size, backend, out_dir, fn, config), world_size)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as file:
                results.append(json.load(file))
    return results


def _start_and_join(main: Callable[..., None], args: tuple, nprocs: int) -> None:
    """Run ``main(index, *args)`` in ``nprocs`` spawned processes until every one has ended;
    raises if one failed. See [Note: stopping the benchmark's processes]."""
    with _sigint_ignored():  # by the processes as they start
        context = mp.start_processes(
            main, args=args, nprocs=nprocs, join=False, start_method="spawn"
        )
    try:
        while not context.join(timeout=1.0):
            pass
    finally:
        _stop(context.processes)


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT in the block (in the main thread; elsewhere signals never arrive), so
    that processes started meanwhile keep ignoring it until they set a handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _end_quietly_on_sigint() -> None:
    """In a rank process: end at once, silently, on SIGINT."""
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))


def _stop(processes: Sequence[Any], grace_s: float = 2.0) -> None:
    """Terminate the processes still running and wait until every one has ended; those
    that outlast ``grace_s`` after SIGTERM are killed."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


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
    with tempfile.TemporaryDirectory(prefix="reffsdp-bench-") as out_dir:
        _start_and_join(_single_main, (out_dir, fn, config), 1)
        with open(os.path.join(out_dir, "result.json")) as file:
            return json.load(file)


def _single_main(index: int, out_dir: str, fn: Callable[..., dict], config: Any) -> None:
    _end_quietly_on_sigint()
    torch.set_num_threads(os.cpu_count() or 1)
    result = fn(config)
    with open(os.path.join(out_dir, "result.json"), "w") as file:
        json.dump(result, file)
