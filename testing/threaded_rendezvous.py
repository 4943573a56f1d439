"""Where the ranks of a threaded group meet for each collective.

[Note: threaded rendezvous]
The ranks of one group share a :class:`GroupRendezvous`. c10d requires every rank to issue
the same collectives on a group in the same order, so each rank numbers its own calls on the
group 0, 1, 2, ... and the n-th calls of all ranks form slot n:

1. A rank deposits its ``RankCall`` in slot n and waits on the job's condition variable.
2. The last rank to arrive checks that the calls agree (same op, reduction, root, dtypes and
   sizes) and computes every rank's results from the inputs (``threaded_ops``: reads only).
   A mismatch or a bad shape becomes an error that *every* rank of the slot raises.
3. Each rank wakes and copies its own results into its own tensors, on its own thread, so
   grad mode, inference mode and the current device are the owner's. Results are private
   snapshots, so a rank that returns first may reuse its buffers while others still copy.
   With CUDA tensors, the devices are synchronized around steps 2 and 3, since the ranks'
   streams are not ordered with each other.

A collective is finished when the call returns, even with ``async_op=True``: the work is
already complete and its future holds the output tensors (DDP's reducer and functional
collectives read those futures). The only difference from NCCL is timing: a rank blocks when
it issues a collective, not when it waits on the work.

Nothing waits forever. A wait ends when the slot completes, when the job is aborted
(:meth:`ThreadedJob.abort`, which the test harness calls as soon as any rank raises), when a
rank that has not joined the slot destroys the group, or when the group's timeout passes;
the timeout also aborts the job, so the other ranks stop waiting too.

All groups created from one root store form a ``ThreadedJob``: one lock, one condition and
one abort flag. Results are computed under that lock, so collectives serialize, which is
fine for tests. The backend's creator function (called by c10d with only a store and ranks)
finds the job through a key in the root store and the module's job table, the one piece of
module state this backend needs.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import traceback
import weakref

import torch
import torch.distributed as dist

from reffsdp.testing.threaded_ops import RankCall, compute_results

_JOB_KEY = "reffsdp/threaded_pg/job"

# The job table: how the backend creator reaches the Python object shared by all ranks.
_jobs: weakref.WeakValueDictionary[str, ThreadedJob] = weakref.WeakValueDictionary()
_jobs_lock = threading.Lock()
_job_ids = itertools.count()


class CollectiveAborted(RuntimeError):
    """Raised by a collective because another rank failed or a wait timed out.

    Harnesses treat it as a consequence, not a cause: the failure worth reporting is the one
    that triggered the abort.
    """


class ThreadedJob:
    """State shared by every threaded group created from one root store (one test run)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.abort_reason: str | None = None
        self._groups: dict[tuple[str, int], GroupRendezvous] = {}
        self._creations: dict[tuple[str, int], int] = {}  # (group name, rank) -> count

    @classmethod
    def for_store(cls, store: dist.Store) -> ThreadedJob:
        """The job of ``store``'s root store, created on first use."""
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        with _jobs_lock:
            if store.check([_JOB_KEY]):
                job = _jobs.get(store.get(_JOB_KEY).decode())
                if job is not None:
                    return job
            token = f"job-{next(_job_ids)}"
            job = _jobs[token] = cls()
            store.set(_JOB_KEY, token)
            return job

    def abort(self, reason: str) -> None:
        """Make every pending and future collective of the job raise ``CollectiveAborted``."""
        with self.cond:
            if self.abort_reason is None:
                self.abort_reason = reason
            self.cond.notify_all()

    def rendezvous(self, name: str, rank: int, ranks: list[int]) -> GroupRendezvous:
        """The rendezvous that ``rank``'s instance of group ``name`` shares with its peers.

        A group name can come back after ``destroy_process_group``; counting how often each
        rank created the name tells the k-th creation on one rank from the (k-1)-th.
        """
        with self.cond:
            count = self._creations.get((name, rank), 0) + 1
            self._creations[(name, rank)] = count
            key = (name, count)
            if key not in self._groups:
                self._groups[key] = GroupRendezvous(self, name, ranks)
            found = self._groups[key]
            found.attached += 1
            if found.attached == len(ranks):
                del self._groups[key]  # every member has it; the table need not keep it
            return found

    def check_not_aborted(self, where: str) -> None:
        if self.abort_reason is not None:
            raise CollectiveAborted(f"{where} aborted: {self.abort_reason}")


@dataclasses.dataclass
class _Slot:
    """The n-th collective of a group: each rank's call, then the results or an error."""

    calls: dict[int, RankCall] = dataclasses.field(default_factory=dict)
    results: list[list[torch.Tensor]] | None = None
    error: str | None = None
    collected: int = 0

    @property
    def finished(self) -> bool:
        return self.results is not None or self.error is not None


class GroupRendezvous:
    """Where the ranks of one group meet for each collective; see [Note: threaded rendezvous]."""

    def __init__(self, job: ThreadedJob, name: str, ranks: list[int]) -> None:
        self.job = job
        self.name = name
        self.ranks = ranks  # global ranks, indexed by group rank
        self.attached = 0
        self._slots: dict[int, _Slot] = {}
        self._departed: set[int] = set()

    def join(self, rank: int, seq: int, call: RankCall, timeout_s: float) -> list[torch.Tensor]:
        """Deposit ``rank``'s call for collective ``seq``; return this rank's results."""
        where = (
            f"{call.describe()} on rank {self.ranks[rank]} "
            f"(collective #{seq} on group {self.name!r}, global ranks {self.ranks})"
        )
        with self.job.cond:
            self.job.check_not_aborted(where)
            slot = self._slots.setdefault(seq, _Slot())
            slot.calls[rank] = call
            if len(slot.calls) == len(self.ranks):
                self._finish(slot)
                self.job.cond.notify_all()
            elif not self.job.cond.wait_for(lambda: self._can_stop(slot), timeout_s):
                missing = [self.ranks[r] for r in range(len(self.ranks)) if r not in slot.calls]
                reason = f"{where} timed out after {timeout_s:g}s; ranks {missing} never joined"
                self.job.abort(reason)
                raise RuntimeError(reason)
            return self._collect(slot, rank, seq, where)

    def leave(self, rank: int) -> None:
        """Record that ``rank`` destroyed its instance of the group; wake anyone waiting on it."""
        with self.job.cond:
            self._departed.add(rank)
            self.job.cond.notify_all()

    def _can_stop(self, slot: _Slot) -> bool:
        absent = self._departed - set(slot.calls)
        return slot.finished or self.job.abort_reason is not None or bool(absent)

    def _finish(self, slot: _Slot) -> None:
        calls = [slot.calls[rank] for rank in range(len(self.ranks))]
        try:
            slot.results = compute_results(calls)
        except ValueError as exc:  # the calls do not fit together: say how
            slot.error = str(exc)
        except Exception:  # every rank must see the failure, not only the last one in
            slot.error = traceback.format_exc()

    def _collect(self, slot: _Slot, rank: int, seq: int, where: str) -> list[torch.Tensor]:
        if not slot.finished:
            self.job.check_not_aborted(where)
            gone = [self.ranks[r] for r in sorted(self._departed - set(slot.calls))]
            raise RuntimeError(f"{where} cannot finish: ranks {gone} destroyed the group")
        slot.collected += 1
        if slot.collected == len(self.ranks):
            del self._slots[seq]
        if slot.error is not None:
            raise RuntimeError(f"{where} failed: {slot.error}")
        return slot.results[rank]
