"""An in-memory c10d backend, ``"threaded"``: every rank is a thread of one process.

``dist.init_process_group("threaded", rank=r, world_size=n, store=store)`` called from n
threads (inside :func:`~reffsdp.testing.thread_world.threaded_world`) gives each thread a
:class:`ThreadedProcessGroup` that exchanges real data with the others. Sub-groups from
``dist.new_group`` and ``init_device_mesh`` work the same way, and so do DTensor's functional
collectives and DDP's reducer, which reach the group through c10d's C++ trampoline.

Three modules share the work: this one adapts c10d's ``ProcessGroup`` methods to one normal
form of call, ``threaded_rendezvous`` brings the ranks' calls together (see [Note: threaded
rendezvous] there for how, and why nothing hangs), and ``threaded_ops`` computes each
collective's results.

Every collective reports itself to :func:`reffsdp.testing.comm_counter.record_collective` on
the issuing rank's thread. A Python process group is called directly, not through torch's
dispatcher, so a ``TorchDispatchMode`` sees no ``c10d.*`` op for it; the counter hook is how
threaded collectives get counted. (Functional collectives are still dispatched, as
``_c10d_functional.*`` ops, before they reach the group; the counter ignores the hook while
it is counting such an op, so nothing is counted twice.)
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import (
    AllreduceCoalescedOptions,
    AllreduceOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from reffsdp.core import comms, compat
from reffsdp.testing import comm_counter, torch_private
from reffsdp.testing.threaded_ops import Op, RankCall, ReduceSpec, write_results
from reffsdp.testing.threaded_rendezvous import CollectiveAborted, GroupRendezvous, ThreadedJob

__all__ = [
    "BACKEND_NAME",
    "CollectiveAborted",
    "ThreadedJob",
    "ThreadedProcessGroup",
    "register_threaded_backend",
]

BACKEND_NAME = "threaded"

# The reduce ops besides SUM the group carries out: PREMUL_SUM only where the op's factor can
# be read (entry 2 of [Note: torch versions] in reffsdp.core.compat).
_REDUCE_OPS = [dist.ReduceOp.AVG]
if compat.PREMUL_SUM_FACTOR_READABLE:
    _REDUCE_OPS.append(dist.ReduceOp.PREMUL_SUM)


def _completed_work(outputs: list[torch.Tensor]) -> dist.Work:
    """A work that is already done; its future's value is the list of output tensors (see
    :func:`reffsdp.testing.torch_private.completed_work` for why it takes a private call)."""
    return torch_private.completed_work(outputs)


class ThreadedProcessGroup(dist.ProcessGroup):
    """One rank's handle on a threaded group; c10d and its C++ callers call these methods.

    Method names follow torch 2.13 (``all_gather_single``, ``reduce_scatter_single``,
    ``all_to_all_single`` and their ``_coalesced`` forms); the torch 2.11 names
    (``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``,
    ``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``) are aliases.
    """

    def __init__(self, rendezvous: GroupRendezvous, rank: int, timeout: timedelta) -> None:
        super().__init__(rank, len(rendezvous.ranks))
        self._rendezvous = rendezvous
        self._timeout_s = timeout.total_seconds()
        self._next_seq = 0  # only this rank's thread issues on this object
        self._group_desc = "undefined"

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"ThreadedProcessGroup(rank={self.rank()}, size={self.size()})"

    @property
    def _device_types(self) -> list[torch.device]:
        # c10d reads the device types from registered C++ backends, which a Python group
        # has none of; state-dict utilities pick their staging device from this list.
        types = [torch.device("cpu")]
        if torch.cuda.is_available():
            types.append(torch.device("cuda"))
        return types

    # c10d keeps a group's name and description on its C++ backends, which a Python group
    # does not have; c10d's Python side sets and reads them through these names instead.
    @property
    def group_name(self) -> str:
        return self._rendezvous.name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_name(self, name: str) -> None:
        if name != self._rendezvous.name:
            raise ValueError(f"group {self._rendezvous.name!r} cannot be renamed to {name!r}")

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: peers waiting for this rank now fail fast."""
        self._rendezvous.leave(self.rank())

    def _run(self, call: RankCall) -> dist.Work:
        """Count, rendezvous, copy this rank's results in; see [Note: threaded rendezvous].

        The tensor math runs with dispatch modes switched off: a real backend's kernels are
        invisible to a ``TorchDispatchMode``, and the rank that happens to arrive last would
        otherwise show every rank's arithmetic to its own modes.
        """
        comm_counter.record_collective(call.op.kind, call.nbytes, self)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        with torch_private.disable_current_modes():
            results = self._rendezvous.join(self.rank(), seq, call, self._timeout_s)
            write_results(call, results)
        return _completed_work(call.outputs)

    # All-reduce and reduce. ---------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        reduce = ReduceSpec.from_op((opts or AllreduceOptions()).reduceOp)
        return self._run(RankCall(Op.ALL_REDUCE, "all_reduce", tensors, tensors, reduce))

    def allreduce_coalesced(self, tensors, opts=None):
        reduce = ReduceSpec.from_op((opts or AllreduceCoalescedOptions()).reduceOp)
        call = RankCall(Op.ALL_REDUCE, "all_reduce_coalesced", tensors, tensors, reduce)
        return self._run(call)

    def reduce(self, tensors, opts=None):
        opts = opts or ReduceOptions()
        outputs = tensors if opts.rootRank == self.rank() else []
        reduce = ReduceSpec.from_op(opts.reduceOp)
        return self._run(RankCall(Op.REDUCE, "reduce", tensors, outputs, reduce, opts.rootRank))

    # Broadcast, barrier, gather, scatter. ---------------------------------------------------

    def broadcast(self, tensors, opts=None):
        root = (opts or BroadcastOptions()).rootRank
        outputs = [] if root == self.rank() else tensors
        return self._run(RankCall(Op.BROADCAST, "broadcast", tensors, outputs, root=root))

    def barrier(self, opts=None):
        return self._run(RankCall(Op.BARRIER, "barrier", [], []))

    def gather(self, output_lists, inputs, opts=None):
        root = (opts or GatherOptions()).rootRank
        outputs = output_lists[0] if output_lists else []
        return self._run(RankCall(Op.GATHER, "gather", inputs, outputs, root=root))

    def scatter(self, outputs, input_lists, opts=None):
        root = (opts or ScatterOptions()).rootRank
        inputs = input_lists[0] if input_lists else []
        return self._run(RankCall(Op.SCATTER, "scatter", inputs, outputs, root=root))

    # All-gather. ------------------------------------------------------------------------------

    def allgather(self, output_lists, inputs, opts=None):
        outputs = [out for per_input in output_lists for out in per_input]
        return self._run(RankCall(Op.ALL_GATHER_LIST, "all_gather", inputs, outputs))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        outputs = [out for per_input in output_lists for out in per_input]
        return self._run(RankCall(Op.ALL_GATHER_LIST, "all_gather_coalesced", inputs, outputs))

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        method = "all_gather_single"
        return self._run(RankCall(Op.ALL_GATHER_TENSOR, method, [input_tensor], [output_tensor]))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        call = RankCall(Op.ALL_GATHER_TENSOR, "all_gather_single_coalesced", inputs, outputs)
        return self._run(call)

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # Reduce-scatter. --------------------------------------------------------------------------

    def reduce_scatter(self, outputs, input_lists, opts=None):
        inputs = [t for per_output in input_lists for t in per_output]
        reduce = ReduceSpec.from_op((opts or ReduceScatterOptions()).reduceOp)
        return self._run(
            RankCall(Op.REDUCE_SCATTER_LIST, "reduce_scatter", inputs, outputs, reduce)
        )

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        reduce = ReduceSpec.from_op((opts or ReduceScatterOptions()).reduceOp)
        call = RankCall(
            Op.REDUCE_SCATTER_TENSOR,
            "reduce_scatter_single",
            [input_tensor],
            [output_tensor],
            reduce,
        )
        return self._run(call)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        reduce = ReduceSpec.from_op((opts or ReduceScatterOptions()).reduceOp)
        method = "reduce_scatter_single_coalesced"
        return self._run(RankCall(Op.REDUCE_SCATTER_TENSOR, method, inputs, outputs, reduce))

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # All-to-all. ------------------------------------------------------------------------------

    def alltoall(self, outputs, inputs, opts=None):
        return self._run(RankCall(Op.ALL_TO_ALL_LIST, "all_to_all", inputs, outputs))

    def all_to_all_single(
        self, output_tensor, input_tensor, output_splits, input_splits, opts=None
    ):
        call = RankCall(Op.ALL_TO_ALL_TENSOR, "all_to_all_single", [input_tensor], [output_tensor])
        call.input_splits, call.output_splits = list(input_splits), list(output_splits)
        return self._run(call)

    alltoall_base = all_to_all_single


def _create_threaded_group(backend_opts, pg_options) -> ThreadedProcessGroup:
    """c10d's creator hook (extended API): one rank's instance of a new group."""
    size = backend_opts.group_size
    ranks = list(backend_opts.global_ranks_in_group) or list(range(size))
    job = ThreadedJob.for_store(backend_opts.store)
    rendezvous = job.rendezvous(backend_opts.group_id, backend_opts.group_rank, ranks)
    return ThreadedProcessGroup(rendezvous, backend_opts.group_rank, backend_opts.timeout)


def register_threaded_backend() -> None:
    """Register (or re-point) c10d's ``"threaded"`` backend at this module.

    Re-registering is idempotent; harnesses call it before every run so that another module
    registering a backend of the same name cannot silently take over.
    """
    comms.register_reduce_ops(BACKEND_NAME, _REDUCE_OPS)
    if torch_private.registered_backend_creator(BACKEND_NAME) is _create_threaded_group:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_threaded_group, extended_api=True, devices=["cpu", "cuda"]
    )


register_threaded_backend()
