"""What collectives the ranks of a multi-process test issued, for the harness's reports.

[Note: collective trace]
c10d requires every rank of a group to issue the same collectives on it in the same order.
When they do not, gloo just waits until its timeout (or aborts the process), so without
help a test with a skipped or mismatched collective only "times out" on every rank. Each
rank process of :class:`~reffsdp.testing.FSDPTest` therefore numbers the collectives it
issues on each group 0, 1, 2, ... (as the threaded group does) and keeps in a small file,
rewritten at every collective, its latest one and how many it issued on each group. The
pytest process reads the files:

* while the test runs, to spot two ranks whose n-th collective on a group differs
  (:func:`find_mismatch`); such a test cannot finish, so the harness stops it at once;
* when a test fails, to name each rank's last collective and the collectives some members
  of a group issued and others did not (:func:`find_unmatched`): the rank that never issued
  collective #n is usually the culprit.

A rank counts what reaches ``ProcessGroup``'s collective methods, which every
``torch.distributed`` collective function calls (reffsdp's ``core/comms.py`` among them).
Collectives issued from C++ (DTensor's functional collectives, DDP's reducer) and
point-to-point sends and receives are not counted. The harness's own last barrier, which
ranks reach once their test has passed, is counted and marked ``closing``.

Each record is one JSON line written at offset 0 of the rank's file; a reader that catches
a write half done gets a line that does not parse and reads again at its next poll.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

# ProcessGroup's collective methods, by their torch 2.13 and torch 2.11 names.
_COLLECTIVE_METHODS = (
    "allreduce",
    "allreduce_coalesced",
    "reduce",
    "broadcast",
    "barrier",
    "monitored_barrier",
    "allgather",
    "allgather_coalesced",
    "all_gather_single",
    "all_gather_single_coalesced",
    "_allgather_base",
    "allgather_into_tensor_coalesced",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "all_to_all_single",
    "alltoall_base",
    "gather",
    "scatter",
)

_CLOSING = " (the harness's barrier after the test passed)"


@dataclasses.dataclass(frozen=True)
class Issued:
    """One collective a rank issued: number ``seq`` (from 0) of those it issued on ``group``."""

    op: str  # the ProcessGroup method, e.g. "allreduce"
    group: str  # the group's name, the same on every rank
    ranks: tuple[int, ...]  # the group's global ranks
    seq: int
    closing: bool  # the harness's last barrier, reached after the test passed

    def describe(self) -> str:
        where = f"{self.op} #{self.seq} on group {self.group!r} (global ranks {list(self.ranks)})"
        return where + (_CLOSING if self.closing else "")


@dataclasses.dataclass(frozen=True)
class RankTrace:
    """What one rank's file says: its last collective and how many it issued on each group."""

    rank: int
    last: Issued
    counts: Mapping[str, int]


class CollectiveRecorder:
    """The rank-process side: numbers this rank's collectives and keeps its file current."""

    def __init__(self, path: str | None) -> None:
        """``path``: the file kept current (``None``: only :attr:`last` is kept)."""
        self._fd = (
            None if path is None else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        )
        self._counts: dict[str, int] = {}
        self._ranks: dict[str, list[int]] = {}
        self.closing = False  # set by the harness before its last barrier
        self.last: Issued | None = None  # the latest collective this rank issued
        self._originals: dict[str, Callable[..., Any]] = {}  # what install() replaced

    def install(self) -> None:
        """Record every collective method call of every group of this process.

        Patches ``ProcessGroup`` until :meth:`uninstall`: a spawned rank process runs one
        test and exits, a joined rank's process goes on to the next.
        """
        for method in _COLLECTIVE_METHODS:
            original = getattr(dist.ProcessGroup, method, None)
            if original is not None:
                self._originals[method] = original
                setattr(dist.ProcessGroup, method, self._recorded(method, original))

    def uninstall(self) -> None:
        """Give ``ProcessGroup`` back the methods :meth:`install` replaced."""
        for method, original in self._originals.items():
            setattr(dist.ProcessGroup, method, original)
        self._originals.clear()

    def _recorded(self, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(group: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
            self.record(group, method)
            return original(group, *args, **kwargs)

        collective.__name__ = method
        return collective

    def record(self, group: dist.ProcessGroup, op: str) -> None:
        name = group.group_name
        if name not in self._ranks:
            try:
                self._ranks[name] = dist.get_process_group_ranks(group)
            except KeyError:  # a group c10d does not know: its ranks are not on record
                self._ranks[name] = []
        seq = self._counts.get(name, 0)
        self._counts[name] = seq + 1
        self.last = Issued(op, name, tuple(self._ranks[name]), seq, self.closing)
        if self._fd is None:
            return
        last = {"op": op, "group": name, "ranks": self._ranks[name], "seq": seq}
        line = json.dumps({"last": last, "closing": self.closing, "counts": self._counts})
        os.pwrite(self._fd, line.encode() + b"\n", 0)


def read_trace(path: str, rank: int) -> RankTrace | None:
    """``rank``'s trace, or ``None`` if it has issued no collective (or is mid-write)."""
    try:
        with open(path, "rb") as file:
            line = file.read().split(b"\n", 1)[0]
        record = json.loads(line)
    except (FileNotFoundError, ValueError):
        return None
    last = record["last"]
    issued = Issued(last["op"], last["group"], tuple(last["ranks"]), last["seq"], record["closing"])
    return RankTrace(rank, issued, record["counts"])


def find_mismatch(traces: Mapping[int, RankTrace]) -> str | None:
    """Say which collective ranks issued differently, if their last collectives show it.

    Rank 0's last being ``allreduce`` #2 on a group and rank 1's ``broadcast`` #2 on the
    same group is such a case; ``allreduce`` #2 against ``allreduce`` #1 is not (rank 1 may
    be on its way).
    """
    by_slot: dict[tuple[str, int], dict[int, Issued]] = {}
    for trace in traces.values():
        by_slot.setdefault((trace.last.group, trace.last.seq), {})[trace.rank] = trace.last
    for (group, seq), issued in sorted(by_slot.items()):
        if len({(one.op, one.closing) for one in issued.values()}) > 1:
            ranks = list(next(iter(issued.values())).ranks)
            parts = ", ".join(
                f"rank {rank} issued {one.op}" + (_CLOSING if one.closing else "")
                for rank, one in sorted(issued.items())
            )
            return f"collective #{seq} on group {group!r} (global ranks {ranks}) differs: {parts}"
    return None


def find_unmatched(traces: Mapping[int, RankTrace]) -> list[str]:
    """For each rank, its last collective if some member of the group had not issued it.

    Rank 0's last being ``allreduce`` #2 on a group on which rank 1 issued only #0 and #1
    gives "allreduce #2 on group ... was issued by rank 0 but not by rank 1 (its last there:
    #1)".
    """
    found = []
    for trace in sorted(traces.values(), key=lambda trace: trace.rank):
        last = trace.last
        behind = []
        for member in last.ranks:
            count = traces[member].counts.get(last.group, 0) if member in traces else 0
            if count <= last.seq:
                behind.append(
                    f"rank {member} (its last there: #{count - 1})"
                    if count
                    else f"rank {member} (none there)"
                )
        if behind:
            found.append(
                f"{last.describe()} was issued by rank {trace.rank} but not by {', '.join(behind)}"
            )
    return found
