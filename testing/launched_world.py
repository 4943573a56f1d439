"""A world started by a launcher outside Python (torchrun, srun): read from the environment,
its process group built, its ranks telling one another of failures.

:func:`reffsdp.testing.launch.launched_world` decides whether this process is such a rank;
this module holds what it needs once it is (see [Note: two ways to be a rank] there).

[Note: reading a launched world]
torchrun gives each worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. srun gives each task ``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``, its step's ``SLURM_STEP_ID`` and the tasks per node in
``SLURM_STEP_TASKS_PER_NODE`` (``"2(x2)"``: two on each of two nodes) or
``SLURM_NTASKS_PER_NODE``; the batch script exports ``MASTER_ADDR`` and ``MASTER_PORT``.
torchrun's variables win (srun may start torchrun, whose workers see both); a batch script
itself has ``SLURM_PROCID`` but no step, and is not a rank. A world is ``nodes x ranks per
node`` (HSDP's mesh), so nodes holding different numbers of ranks are refused.

[Note: failures in a launched world]
No launcher process listens to a launched rank, so the ranks tell one another, through the
store the world met in (a :class:`FaultBoard`): a rank whose work raised posts its message
whole, a rank its launcher stops (SIGTERM: torchrun stops a node's other workers when one
fails) posts that, and every rank beats (a counter it raises twice a second) until it
finishes. A rank killed outright posts nothing and stops beating: after
:data:`SILENT_S` without a beat it counts as gone. Rank 0 reads the board to report every
failure with the rank named (:meth:`FaultBoard.failures`); each rank's own wait for its work
watches it too, so no rank waits in a collective whose peers are gone
(:meth:`reffsdp.testing.launch.JoinedRank.messages`). Process groups time out with the
caller's timeout, which bounds what the board cannot see.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

SILENT_S = 5.0  # a rank that has not beaten for this long is gone
_POLL_S = 0.2
_generations = itertools.count()  # one store prefix per group this process builds


class LaunchError(ValueError):
    """The environment names a launched world, but not a whole or usable one."""


@dataclasses.dataclass(frozen=True)
class LaunchedEnv:
    """What the launcher said about this rank and its world."""

    launcher: str  # "torchrun" | "srun"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # ranks on this node
    master_addr: str
    master_port: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size


_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SRUN = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT")


def read_launched_env(environ: Mapping[str, str] = os.environ) -> LaunchedEnv | None:
    """This rank's launched world, or ``None`` when no launcher started this process; see
    [Note: reading a launched world]. :class:`LaunchError` for a world half described."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        _require(environ, _TORCHRUN, "torchrun")
        local = _int(environ, "LOCAL_WORLD_SIZE")
        return _launched("torchrun", environ, "RANK", "WORLD_SIZE", "LOCAL_RANK", local)
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        _require(environ, _SRUN, "srun")
        local = _tasks_per_node(environ)
        return _launched("srun", environ, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local)
    return None


def _launched(launcher, environ, rank_key, size_key, local_key, local_world_size) -> LaunchedEnv:
    world = LaunchedEnv(
        launcher,
        _int(environ, rank_key),
        _int(environ, size_key),
        _int(environ, local_key),
        local_world_size,
        environ["MASTER_ADDR"],
        _int(environ, "MASTER_PORT"),
    )
    if not 0 <= world.rank < world.world_size or world.world_size % local_world_size:
        raise LaunchError(
            f"{launcher} gave rank {world.rank} of {world.world_size} with "
            f"{local_world_size} ranks per node: every node must hold as many ranks, and "
            "the rank must be below the world size"
        )
    return world


def _require(environ: Mapping[str, str], names: tuple[str, ...], launcher: str) -> None:
    missing = [name for name in names if not environ.get(name)]
    if missing:
        hint = " (export them in the batch script)" if launcher == "srun" else ""
        raise LaunchError(
            f"{launcher} started this process but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set{hint}"
        )


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise LaunchError(f"{name}={environ[name]!r} is not a whole number") from None


def _tasks_per_node(environ: Mapping[str, str]) -> int:
    """Ranks per node from srun's variables: ``"2(x3),2"`` is 2 on each of 4 nodes."""
    text = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_NTASKS_PER_NODE")
    if not text:
        raise LaunchError(
            "srun started this process but neither SLURM_STEP_TASKS_PER_NODE nor "
            "SLURM_NTASKS_PER_NODE is set"
        )
    counts = set()
    for part in text.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if found is None:
            raise LaunchError(f"cannot read tasks per node from {text!r}")
        counts.add(int(found.group(1)))
    if len(counts) != 1:
        raise LaunchError(
            f"tasks per node {text!r} differ between nodes; give every node as many "
            "(srun --ntasks-per-node)"
        )
    return counts.pop()


# ---- a rank of a launched world -------------------------------------------------------------


class JoinedWorld:
    """This process's rank of a launched world: what :class:`RankWorld` tells a spawned rank
    (``rank``, ``world_size``, ``directory``, ``init_process_group``), and the node layout."""

    joined = True

    def __init__(self, env: LaunchedEnv) -> None:
        self.env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.local_rank, self.local_world_size = env.local_rank, env.local_world_size
        self.nodes, self.launcher = env.nodes, env.launcher
        self.directory = tempfile.mkdtemp(prefix="reffsdp-rank-")  # this rank's own
        self.board: FaultBoard | None = None

    def init_process_group(self, backend: str, timeout: timedelta) -> None:
        """Build the default process group from the launcher's store, under a prefix of its
        own (groups built one after another never read each other's keys)."""
        store = _launch_store(self.env.master_addr, self.env.master_port, self.rank,
                              self.world_size)  # fmt: skip
        store.set_timeout(timeout)
        prefix = dist.PrefixStore(f"reffsdp/{next(_generations)}", store)
        self.board = FaultBoard(dist.PrefixStore("faults", prefix), self.rank, self.world_size)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("group", prefix),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )

    def post_failure(self, text: str) -> None:
        if self.board is not None:
            self.board.post(text)

    def failures(self, wait_s: float) -> dict[int, str]:
        return {} if self.board is None else self.board.failures(wait_s)


@functools.cache
def _launch_store(addr: str, port: int, rank: int, world_size: int) -> dist.Store:
    """The store the launched world meets in, one per process: torchrun's agent's, or one
    rank 0 serves (srun)."""
    url = f"tcp://{addr}:{port}?rank={rank}&world_size={world_size}"
    store, _, _ = next(dist.rendezvous(url, timeout=timedelta(minutes=5)))
    return store


class FaultBoard:
    """Posts, beats and ends of the ranks of one group; see [Note: failures in a launched
    world]."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (beats, when they changed)
        self._lock = threading.Lock()

    def post(self, text: str) -> None:
        record = json.dumps({"text": text, "order": self.store.add("order", 1)})
        self.store.set(f"failed/{self.rank}", record)

    def beat(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)

    def finish(self) -> None:
        self.store.set(f"done/{self.rank}", "1")

    def posted(self) -> dict[int, dict]:
        found = {}
        for rank in range(self.world_size):
            if self._has(f"failed/{rank}"):
                found[rank] = json.loads(self.store.get(f"failed/{rank}"))
        return found

    def silent(self) -> list[int]:
        """Peers neither finished nor posted that have not beaten for :data:`SILENT_S`."""
        now, gone = time.monotonic(), []
        for peer in range(self.world_size):
            if peer == self.rank or self._has(f"done/{peer}") or self._has(f"failed/{peer}"):
                continue
            beats = self.store.add(f"beat/{peer}", 0)
            with self._lock:
                last, since = self._seen.get(peer, (-1, now))
                if beats != last:
                    self._seen[peer] = (beats, now)
                elif now - since > SILENT_S:
                    gone.append(peer)
        return gone

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def failures(self, wait_s: float) -> dict[int, str]:
        """Every other rank's failure (posted, or gone silent), waiting up to ``wait_s`` for
        each peer that has not finished to post or fall silent; by rank, causes first."""
        deadline = time.monotonic() + wait_s
        while True:
            posted, silent = self.posted(), self.silent()
            waiting = [
                peer
                for peer in range(self.world_size)
                if peer != self.rank and peer not in posted and peer not in silent
                and not self._has(f"done/{peer}")
            ]  # fmt: skip
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        found = {peer: f"ended without a word (killed?): no beat for {SILENT_S:g} s"
                 for peer in silent}  # fmt: skip
        for peer, record in sorted(posted.items(), key=lambda item: item[1]["order"]):
            found.setdefault(peer, record["text"])
        return found
