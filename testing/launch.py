"""Start the rank processes of a run, talk to them, and stop them.

The one launcher behind the multi-process harness (:class:`~reffsdp.testing.FSDPTest`), the
parity suite's gloo and nccl backends and the benchmark (``python -m reffsdp.bench``)::

    def main(world: RankWorld, channel: Connection, steps: int) -> None:
        world.init_process_group("gloo", timedelta(minutes=5))
        channel.send(train(steps))

    with spawn_ranks(main, world_size=2, args=(3,)) as ranks:
        results = dict(ranks.messages())  # {rank: what it sent}

It lives in ``reffsdp.testing`` because everything that starts ranks is a test or a
measurement: the benchmark under ``reffsdp/bench`` already builds on ``reffsdp.testing``
(its models, collective counter and threaded ranks), and nothing in ``reffsdp.testing``
imports the benchmark, so the arrow keeps pointing one way.

[Note: two ways to be a rank]
Rank code is a function ``main(world, channel, *args)``: it sees only a world (its rank,
the world's size, a folder of its own, how the world meets) and a channel to whoever waits
for its results, and it builds the process group itself (``world.init_process_group``).
:func:`start_ranks` decides how the ranks come to be, and is the one place that does:

* spawn (:func:`spawn_ranks`): this process starts ``world_size`` children, one pipe
  each, and is the launcher; each child's world is a :class:`RankWorld`.
* join (:func:`join_ranks`): a launcher outside Python (torchrun, srun) started this
  process as one rank of its world (:func:`launched_world` reads it from the environment:
  [Note: reading a launched world] in :mod:`reffsdp.testing.launched_world`). The same rank
  code runs on a thread of this process, its world a
  :class:`~reffsdp.testing.launched_world.JoinedWorld`, and its channel leads back to this
  process: :class:`JoinedRank` gives what it sent as :class:`RankProcesses` gives what
  children sent, so the caller does not tell the two apart, except that it hears its own
  rank only. Rank code that reports for the world does so on rank 0, and reads the other
  ranks' failures from ``world.failures()`` ([Note: failures in a launched world]); a
  spawned world's failures reach its launcher instead, so there it is empty.

[Note: start methods]
``"spawn"`` starts each rank as a fresh interpreter, which imports torch itself (seconds)
and reads its environment when it starts: the benchmark's ``LD_PRELOAD`` heap counter
needs that. ``"forkserver"`` forks each rank from a server process that imported
``preload`` once (the harness's choice: [Note: start-up cost] in
:mod:`reffsdp.testing.multiprocess`); a forked rank is then given what a spawned one
inherits from this process: the environment, stdout and stderr (so pytest captures what
ranks print). multiprocessing itself hands both kinds ``sys.path`` and the working folder.

[Note: stopping rank processes]
Ctrl-C reaches the launching process, and with it (a signal to the process group) every
rank process. Ranks start with SIGINT ignored (no traceback while they import torch) and
then end at once on it, saying nothing (exit status 130): ranks left running would report
their peers' disappearance as errors. The launching process, interrupted or not, stops
every rank when it leaves the ``with`` block (:meth:`RankProcesses.close`: SIGTERM, and
SIGKILL for a rank that outlasts the grace period), so no rank outlives the run. When the
launching process is killed (SIGKILL, or SIGTERM, which Python does not handle) it cannot,
so every rank watches its channel from a thread: the launcher never writes to a rank, so
the channel turning readable means end-of-file, the launcher gone, and the rank exits. On
Linux the kernel backs this up: a rank asks for SIGKILL when its parent ends
(``PR_SET_PDEATHSIG``; the parent is the launching thread, or the fork server, which ends
with the launching process), which covers a rank whose main thread holds the interpreter
lock.

[Note: a rank's failure]
An exception that leaves rank code is sent to the launcher as a :class:`RankError` (the
rank and its traceback), and the rank exits with status 1. On the launching side
:meth:`RankProcesses.receive` and :meth:`RankProcesses.messages` raise :class:`RankFailed`,
which names the rank: with its traceback, or, for a rank that ended without a word (killed,
``os._exit``), with its exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import DupFd
from typing import Any

import torch.distributed as dist

from .launched_world import JoinedWorld, read_launched_env

START_METHODS = ("spawn", "forkserver")
GRACE_S = 2.0  # how long a rank gets to end on SIGTERM (or on its own) before SIGKILL
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_ORPHANED_EXIT_CODE = 70  # a rank that found its launcher gone
_BEAT_S = 0.5  # how often a joined rank beats (see [Note: failures in a launched world])
_PEER_GRACE_S = 15.0  # how long a joined rank's work may go on silent after a peer failed

RankMain = Callable[..., None]  # main(world: RankWorld, channel: Connection, *args)


@dataclasses.dataclass(frozen=True)
class RankWorld:
    """Where one rank stands: its rank, the world's size, and a folder the world shares.

    ``directory`` holds the rendezvous file and whatever the ranks leave there for the
    launcher (the harness's stack dumps and collective traces); it is removed with the ranks.
    """

    rank: int
    world_size: int
    directory: str

    joined = False  # see [Note: two ways to be a rank]
    launcher = "spawn"
    nodes = 1

    @property
    def local_rank(self) -> int:
        return self.rank

    @property
    def local_world_size(self) -> int:
        return self.world_size

    @property
    def store_path(self) -> str:
        return os.path.join(self.directory, "store")

    def post_failure(self, text: str) -> None:
        """Nothing to do: a spawned rank's failure reaches its launcher."""

    def failures(self, wait_s: float) -> dict[int, str]:
        return {}

    def init_process_group(self, backend: str, timeout: timedelta) -> None:
        """Build the default process group of this world, meeting through a file store."""
        dist.init_process_group(
            backend,
            store=dist.FileStore(self.store_path, self.world_size),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )


@dataclasses.dataclass(frozen=True)
class RankError:
    """Sent by a rank whose code raised; see [Note: a rank's failure]."""

    rank: int
    traceback: str


class RankFailed(RuntimeError):
    """A rank raised (``detail`` is its traceback) or ended without reporting
    (``silent``; ``detail`` gives its exit code)."""

    def __init__(self, rank: int, detail: str, *, silent: bool = False) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail
        self.silent = silent


@dataclasses.dataclass(frozen=True)
class _Ended:
    """What a rank's channel yields once the rank has ended."""

    exit_code: int | None  # None: still ending after the grace period


# ---- inside a rank process ----------------------------------------------------------------


@dataclasses.dataclass
class _Inherited:
    """What a forked rank is handed to be like a spawned one; see [Note: start methods]."""

    environment: dict[str, str]
    stdout: Any  # DupFd of this process's fd 1
    stderr: Any  # ... and fd 2

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environment)
        os.dup2(self.stdout.detach(), 1)
        os.dup2(self.stderr.detach(), 2)


def _rank_entry(
    main: RankMain,
    world: RankWorld,
    channel: Connection,
    args: tuple[Any, ...],
    inherited: _Inherited | None,
) -> None:
    """A rank process: run ``main``, reporting an exception that leaves it."""
    _end_quietly_on_sigint()
    _exit_with_launcher(channel)
    if inherited is not None:
        inherited.restore()
    try:
        main(world, channel, *args)
    except Exception:
        channel.send(RankError(world.rank, traceback.format_exc()))
        raise SystemExit(1) from None


def _end_quietly_on_sigint() -> None:
    """End at once, silently, on SIGINT; see [Note: stopping rank processes]."""
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))


def _exit_with_launcher(channel: Connection) -> None:
    """End this rank soon after the launching process; see [Note: stopping rank processes]."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    def exit_once_the_launcher_is_gone() -> None:
        wait([channel])  # readable only at end-of-file: the launcher never writes to a rank
        os._exit(_ORPHANED_EXIT_CODE)

    threading.Thread(
        target=exit_once_the_launcher_is_gone, name="exit-with-launcher", daemon=True
    ).start()


# ---- in the launching process -------------------------------------------------------------


def spawn_ranks(
    main: RankMain,
    world_size: int,
    args: Sequence[Any] = (),
    *,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
    name: str = "reffsdp",
) -> RankProcesses:
    """Start ``world_size`` processes, each running ``main(world, channel, *args)``.

    ``main`` and ``args`` are pickled, so ``main`` must be importable (defined at module
    level). ``start_method`` is ``"spawn"`` or ``"forkserver"`` (whose server imports the
    modules in ``preload`` once); see [Note: start methods]. Use the result as a context
    manager, or call its :meth:`~RankProcesses.close`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    return RankProcesses(main, world_size, tuple(args), start_method, tuple(preload), name)


class RankProcesses:
    """The rank processes of one run, a pipe to each, and the folder they share."""

    def __init__(
        self,
        main: RankMain,
        world_size: int,
        args: tuple[Any, ...],
        start_method: str,
        preload: tuple[str, ...],
        name: str,
    ) -> None:
        self.directory = tempfile.mkdtemp(prefix="reffsdp-ranks-")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._channels: list[Connection] = []
        self._ended: set[int] = set()  # ranks whose end has been received
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            context.set_forkserver_preload(list(preload))
        try:
            with _sigint_ignored():  # by the ranks as they start
                for rank in range(world_size):
                    ours, theirs = context.Pipe()
                    inherited = None
                    if start_method == "forkserver":
                        inherited = _Inherited(dict(os.environ), DupFd(1), DupFd(2))
                    process = context.Process(
                        target=_rank_entry,
                        args=(main, RankWorld(rank, world_size, self.directory), theirs, args,
                              inherited),
                        name=f"{name}-rank{rank}",
                        daemon=True,
                    )  # fmt: skip
                    process.start()
                    theirs.close()  # so that the rank's end reads as end-of-file on ours
                    self.processes.append(process)
                    self._channels.append(ours)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return len(self.processes)

    def pid(self, rank: int) -> int | None:
        return self.processes[rank].pid

    def ready(self, ranks: Iterable[int], timeout: float | None) -> list[int]:
        """Those of ``ranks`` with something to receive (a message, or their end) within
        ``timeout`` seconds (``None``: until one has)."""
        by_channel = {self._channels[rank]: rank for rank in ranks}
        return sorted(by_channel[channel] for channel in wait(list(by_channel), timeout))

    def receive(self, rank: int) -> Any:
        """The next message ``rank`` sent; :class:`RankFailed` if it raised instead, or
        ended without one. Blocks until there is one."""
        message = self._receive(rank)
        if isinstance(message, _Ended):
            raise RankFailed(rank, f"its exit code was {message.exit_code}", silent=True)
        return message

    def messages(self) -> Iterator[tuple[int, Any]]:
        """``(rank, message)`` as the ranks send them, until every rank has ended; a rank
        that raised, or ended with an exit status other than 0, raises :class:`RankFailed`.
        Ranks whose end was already received are not waited for."""
        running = set(range(self.world_size)) - self._ended
        while running:
            for rank in self.ready(running, None):
                message = self._receive(rank)
                if not isinstance(message, _Ended):
                    yield rank, message
                    continue
                running.discard(rank)
                if message.exit_code not in (0, None):
                    detail = f"its exit code was {message.exit_code}"
                    raise RankFailed(rank, detail, silent=True)

    def _receive(self, rank: int) -> Any:
        try:
            message = self._channels[rank].recv()
        except EOFError:
            self._ended.add(rank)
            return _Ended(self._exit_code(rank))
        if isinstance(message, RankError):
            raise RankFailed(rank, message.traceback)
        return message

    def _exit_code(self, rank: int) -> int | None:
        """The exit code of a rank whose channel closed (``None`` if it is still ending)."""
        process = self.processes[rank]
        process.join(GRACE_S)
        return process.exitcode

    def close(self, grace_s: float = GRACE_S, *, finishing: Collection[int] = ()) -> None:
        """Stop every rank and remove the shared folder; see [Note: stopping rank processes].

        The ranks not in ``finishing`` (those known to be ending on their own) are
        terminated; any rank still running ``grace_s`` later is killed.
        """
        for rank, process in enumerate(self.processes):
            if rank not in finishing and process.is_alive():
                process.terminate()
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for channel in self._channels:
            channel.close()
        shutil.rmtree(self.directory, ignore_errors=True)


# ---- joining a launched world -------------------------------------------------------------


def launched_world() -> JoinedWorld | None:
    """This process's rank of a world torchrun or srun started, or ``None`` when no
    launcher started it; see [Note: two ways to be a rank]."""
    env = read_launched_env()
    return None if env is None else JoinedWorld(env)


def start_ranks(
    main: RankMain, world_size: int, args: Sequence[Any] = (), **spawn_options: Any
) -> RankProcesses | JoinedRank:
    """Join the launched world when there is one, else spawn ``world_size`` ranks
    (``spawn_options`` go to :func:`spawn_ranks`); see [Note: two ways to be a rank]."""
    world = launched_world()
    if world is None:
        return spawn_ranks(main, world_size, args, **spawn_options)
    if world_size != world.world_size:
        raise ValueError(
            f"{world_size} ranks asked for, but {world.launcher} launched {world.world_size}"
        )
    return join_ranks(main, world, args)


def join_ranks(main: RankMain, world: JoinedWorld, args: Sequence[Any] = ()) -> JoinedRank:
    """Run ``main(world, channel, *args)`` as this process's rank of ``world``."""
    return JoinedRank(main, world, tuple(args))


class _LocalChannel:
    """A joined rank's channel: what it sends goes to this process's :class:`JoinedRank`."""

    def __init__(self, inbox: queue.SimpleQueue) -> None:
        self._inbox = inbox

    def send(self, message: Any) -> None:
        self._inbox.put(message)


class JoinedRank:
    """This process's rank of a launched world, heard as :class:`RankProcesses` hears its
    children; see [Note: two ways to be a rank]."""

    def __init__(self, main: RankMain, world: JoinedWorld, args: tuple[Any, ...]) -> None:
        self.world = world
        self.directory = world.directory
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._previous_sigterm = _post_on_sigterm(world)
        self._thread = threading.Thread(
            target=self._run, args=(main, args), name=f"rank{world.rank}", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> JoinedRank:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return self.world.world_size

    def _run(self, main: RankMain, args: tuple[Any, ...]) -> None:
        try:
            main(self.world, _LocalChannel(self._inbox), *args)
        except Exception:
            text = traceback.format_exc()
            self.world.post_failure(text)
            self._inbox.put(RankError(self.world.rank, text))
        else:
            if self.world.board is not None:
                self.world.board.finish()
        self._inbox.put(_Ended(0))

    def messages(self) -> Iterator[tuple[int, Any]]:
        """``(rank, message)`` for what this rank sends, until it ends; :class:`RankFailed`
        if it raised, or when a peer failed and this rank's work has said nothing for
        :data:`_PEER_GRACE_S` since (it waits in a collective whose peers are gone)."""
        heard = time.monotonic()
        while True:
            try:
                message = self._inbox.get(timeout=_BEAT_S)
            except queue.Empty:
                self._watch_peers(heard)
                continue
            heard = time.monotonic()
            if isinstance(message, RankError):
                raise RankFailed(message.rank, message.traceback)
            if isinstance(message, _Ended):
                return
            yield self.world.rank, message

    def _watch_peers(self, heard: float) -> None:
        board = self.world.board
        if board is None:  # no group yet
            return
        board.beat()
        if not board.posted() and not board.silent():
            return
        if time.monotonic() - heard > _PEER_GRACE_S:
            peer, text = next(iter(board.failures(0.0).items()))
            raise RankFailed(peer, text)

    def close(self) -> None:
        """Give the rank's work a moment to end, then leave it (a daemon thread)."""
        self._thread.join(GRACE_S)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        shutil.rmtree(self.directory, ignore_errors=True)


def _post_on_sigterm(world: JoinedWorld) -> Any:
    """On SIGTERM (a launcher stopping its node's ranks), post it, then end; see [Note:
    failures in a launched world]. Returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stopped(signum: int, frame: Any) -> None:
        with contextlib.suppress(Exception):
            world.post_failure("stopped by SIGTERM: its launcher ended it")
        os._exit(128 + signum)

    return signal.signal(signal.SIGTERM, stopped)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT in the block (in the main thread; elsewhere signals never arrive).

    A process started meanwhile keeps SIGINT ignored until it sets a handler of its own,
    so a Ctrl-C while it imports torch prints no traceback.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
