"""What each collective computes, written as pure functions of every rank's arguments.

The threaded process group collects one :class:`RankCall` per rank of a group and hands the
list to :func:`compute_results`. That function checks that the calls agree, reads the ranks'
input tensors and returns, for every rank, fresh tensors holding what that rank's output
tensors must receive. It never writes to a rank's tensors: each rank copies its own results
on its own thread (see [Note: threaded rendezvous] in ``threaded_rendezvous.py``).

Worked example, reduce-scatter of 4 numbers on 2 ranks with ``SUM``::

    rank 0 input [1, 2, 3, 4]    rank 1 input [10, 20, 30, 40]
    rank 0 gets  [11, 22]        rank 1 gets  [33, 44]

With ``PREMUL_SUM`` and factor 0.5 every input is scaled first: rank 0 gets [5.5, 11].
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch
import torch.distributed as dist

from reffsdp.core import compat
from reffsdp.core.comms import Collective

RedOpType = dist.ReduceOp.RedOpType

_COMBINE: dict[RedOpType, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    RedOpType.SUM: torch.add,
    RedOpType.AVG: torch.add,
    RedOpType.PREMUL_SUM: torch.add,
    RedOpType.PRODUCT: torch.mul,
    RedOpType.MIN: torch.minimum,
    RedOpType.MAX: torch.maximum,
    RedOpType.BAND: torch.bitwise_and,
    RedOpType.BOR: torch.bitwise_or,
    RedOpType.BXOR: torch.bitwise_xor,
}


class Op(enum.Enum):
    """The forms of collective the threaded group implements."""

    ALL_REDUCE = "all_reduce"
    REDUCE = "reduce"
    BROADCAST = "broadcast"
    ALL_GATHER_TENSOR = "all_gather_tensor"  # flat output: every rank's input, in rank order
    ALL_GATHER_LIST = "all_gather_list"  # one output tensor per (input, source rank)
    REDUCE_SCATTER_TENSOR = "reduce_scatter_tensor"  # flat input cut into equal rank chunks
    REDUCE_SCATTER_LIST = "reduce_scatter_list"  # one input tensor per (output, dest rank)
    ALL_TO_ALL_TENSOR = "all_to_all_tensor"  # dim-0 split sizes, or equal splits
    ALL_TO_ALL_LIST = "all_to_all_list"
    GATHER = "gather"
    SCATTER = "scatter"
    BARRIER = "barrier"

    @property
    def kind(self) -> Collective:
        """The kind the comm counter records this form under: the name less its form."""
        return Collective(self.value.removesuffix("_tensor").removesuffix("_list"))

    @property
    def sized_by_output(self) -> bool:
        """Whether the comm counter sizes this collective by its outputs (else its inputs)."""
        return self in (Op.ALL_GATHER_TENSOR, Op.ALL_GATHER_LIST, Op.SCATTER)


@dataclasses.dataclass(frozen=True)
class ReduceSpec:
    """A reduction: its type and, for ``PREMUL_SUM``, the factor this rank scales by."""

    kind: RedOpType
    factor: float | torch.Tensor | None = None

    @classmethod
    def from_op(cls, op: dist.ReduceOp | RedOpType) -> ReduceSpec:
        """Read a reduction from ``opts.reduceOp`` (a ``ReduceOp``) or a bare ``RedOpType``."""
        kind = op.op if isinstance(op, dist.ReduceOp) else op
        if kind not in _COMBINE:
            raise ValueError(f"the threaded process group does not implement {kind}")
        factor = compat.premul_sum_factor(op) if kind == RedOpType.PREMUL_SUM else None
        return cls(kind, factor)

    @property
    def name(self) -> str:
        return self.kind.name


@dataclasses.dataclass
class RankCall:
    """One rank's side of a collective, normalized to lists of input and output tensors.

    ``outputs`` may alias ``inputs`` (all-reduce works in place); the results are computed
    from the inputs before any output is written, so aliasing is safe.
    """

    op: Op
    method: str  # the ProcessGroup method the caller used, for messages
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    reduce: ReduceSpec | None = None
    root: int | None = None  # group rank of the source or destination
    input_splits: list[int] | None = None  # all-to-all only
    output_splits: list[int] | None = None

    @property
    def nbytes(self) -> int:
        """This rank's size of the collective, by the comm counter's rule.

        [Note: what nbytes means] in ``comm_counter.py``: the whole buffer on one rank, i.e.
        the unsharded side for all-gather (output) and reduce-scatter (input), the tensor for
        all-reduce, broadcast and reduce, the input for all-to-all and gather, the output for
        scatter, nothing for a barrier.
        """
        tensors = self.outputs if self.op.sized_by_output else self.inputs
        return sum(t.numel() * t.element_size() for t in tensors)

    def signature(self) -> tuple:
        """What must be identical on every rank for the calls to be one collective."""
        if self.op is Op.SCATTER:
            data = [(t.dtype, t.numel()) for t in self.outputs]
        elif self.op in (Op.ALL_TO_ALL_TENSOR, Op.ALL_TO_ALL_LIST):
            data = [t.dtype for t in self.inputs]  # split sizes may differ per rank
        else:
            data = [(t.dtype, t.numel()) for t in self.inputs]
        kind = self.reduce.kind if self.reduce is not None else None
        return (self.op, kind, self.root, tuple(data))

    def describe(self) -> str:
        """A short human-readable form, e.g. ``all_reduce(SUM, float32[4])``."""
        tensors = self.outputs if self.op is Op.SCATTER else self.inputs
        parts = [self.reduce.name] if self.reduce is not None else []
        if self.root is not None:
            parts.append(f"root={self.root}")
        parts += [f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors]
        return f"{self.method}({', '.join(parts)})"


def reduce_tensors(tensors: list[torch.Tensor], specs: list[ReduceSpec]) -> torch.Tensor:
    """Combine one tensor per rank, in rank order, in the tensors' own dtype."""
    kind = specs[0].kind
    dtype = tensors[0].dtype
    if kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR) and (
        dtype.is_floating_point or dtype.is_complex
    ):
        raise ValueError(f"ReduceOp.{kind.name} needs an integer or bool dtype, got {dtype}")
    if kind == RedOpType.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.AVG needs a floating-point dtype, got {dtype}")
    terms = [t.detach() for t in tensors]
    if kind == RedOpType.PREMUL_SUM:
        terms = [_premultiply(t, spec.factor) for t, spec in zip(terms, specs)]
    device = terms[0].device
    result = terms[0].clone()
    for term in terms[1:]:
        result = _COMBINE[kind](result, term.to(device))
    if kind == RedOpType.AVG:
        result = result / len(terms)
    return result.to(dtype)


def _premultiply(tensor: torch.Tensor, factor: float | torch.Tensor | None) -> torch.Tensor:
    if factor is None:
        raise ValueError("ReduceOp.PREMUL_SUM arrived without a factor")
    if isinstance(factor, torch.Tensor):
        factor = factor.to(tensor.device)
    return torch.mul(tensor, factor).to(tensor.dtype)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1)


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy, so the owner may reuse its tensor once its own call returns."""
    return tensor.detach().clone()


def _equal_chunks(tensor: torch.Tensor, size: int, what: str) -> list[torch.Tensor]:
    numel = tensor.numel()
    if numel % size:
        raise ValueError(f"{what} has {numel} elements, which {size} ranks cannot split evenly")
    return list(_flat(tensor).split(numel // size))


def _check_per_rank_lists(calls: list[RankCall], field: str, groups: int) -> None:
    """List forms pass one tensor per rank (times ``groups``); anything else cannot route."""
    for rank, call in enumerate(calls):
        count = len(getattr(call, field))
        if count != groups * len(calls):
            raise ValueError(
                f"rank {rank}: {call.method} passed {count} {field} for {len(calls)} ranks"
            )


def _all_reduce(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    specs = [call.reduce for call in calls]
    reduced = [
        reduce_tensors([c.inputs[j] for c in calls], specs) for j in range(len(calls[0].inputs))
    ]
    return [reduced for _ in calls]


def _reduce(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    reduced = _all_reduce(calls)[0]
    return [reduced if rank == calls[0].root else [] for rank in range(len(calls))]


def _broadcast(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    root = calls[0].root
    sent = [_snapshot(t) for t in calls[root].inputs]
    return [[] if rank == root else sent for rank in range(len(calls))]


def _all_gather_tensor(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    count = len(calls[0].inputs)
    gathered = [torch.cat([_flat(c.inputs[j]) for c in calls]) for j in range(count)]
    return [gathered for _ in calls]


def _all_gather_list(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    count = len(calls[0].inputs)
    gathered = [_snapshot(c.inputs[j]) for j in range(count) for c in calls]
    return [gathered for _ in calls]


def _reduce_scatter_tensor(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    size, specs = len(calls), [call.reduce for call in calls]
    results: list[list[torch.Tensor]] = [[] for _ in calls]
    for j in range(len(calls[0].inputs)):
        chunks = [_equal_chunks(c.inputs[j], size, f"{c.method} input #{j}") for c in calls]
        for dest in range(size):
            results[dest].append(reduce_tensors([c[dest] for c in chunks], specs))
    return results


def _reduce_scatter_list(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    size, specs = len(calls), [call.reduce for call in calls]
    _check_per_rank_lists(calls, "inputs", len(calls[0].outputs))
    count = len(calls[0].outputs)
    return [
        [reduce_tensors([c.inputs[j * size + dest] for c in calls], specs) for j in range(count)]
        for dest in range(size)
    ]


def _all_to_all_tensor(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    size = len(calls)
    pieces = []  # pieces[src][dest]: the rows src sends to dest
    for src, call in enumerate(calls):
        data = call.inputs[0].detach()
        splits = call.input_splits or [data.shape[0] // size] * size
        if len(splits) != size or sum(splits) != data.shape[0]:
            raise ValueError(
                f"rank {src}: input split sizes {splits} do not cover dim 0 {data.shape[0]}"
            )
        pieces.append(data.split(splits))
    results = []
    for dest, call in enumerate(calls):
        received = [pieces[src][dest] for src in range(size)]
        wanted = call.output_splits
        if wanted and wanted != [p.shape[0] for p in received]:
            got = [p.shape[0] for p in received]
            raise ValueError(f"rank {dest}: output split sizes {wanted} but the ranks send {got}")
        results.append([torch.cat(received)])
    return results


def _all_to_all_list(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    _check_per_rank_lists(calls, "inputs", 1)
    return [[_snapshot(src.inputs[dest]) for src in calls] for dest in range(len(calls))]


def _gather(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    gathered = [_snapshot(c.inputs[0]) for c in calls]
    return [gathered if rank == calls[0].root else [] for rank in range(len(calls))]


def _scatter(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    root_inputs = calls[calls[0].root].inputs
    if len(root_inputs) != len(calls):
        raise ValueError(f"scatter source passed {len(root_inputs)} tensors for {len(calls)} ranks")
    return [[_snapshot(root_inputs[rank])] for rank in range(len(calls))]


_COMPUTE: dict[Op, Callable[[list[RankCall]], list[list[torch.Tensor]]]] = {
    Op.ALL_REDUCE: _all_reduce,
    Op.REDUCE: _reduce,
    Op.BROADCAST: _broadcast,
    Op.ALL_GATHER_TENSOR: _all_gather_tensor,
    Op.ALL_GATHER_LIST: _all_gather_list,
    Op.REDUCE_SCATTER_TENSOR: _reduce_scatter_tensor,
    Op.REDUCE_SCATTER_LIST: _reduce_scatter_list,
    Op.ALL_TO_ALL_TENSOR: _all_to_all_tensor,
    Op.ALL_TO_ALL_LIST: _all_to_all_list,
    Op.GATHER: _gather,
    Op.SCATTER: _scatter,
    Op.BARRIER: lambda calls: [[] for _ in calls],
}


def check_calls_match(calls: list[RankCall]) -> None:
    """Raise ``ValueError`` naming every rank's call unless all ranks issued the same one."""
    if len({call.signature() for call in calls}) > 1:
        lines = "\n".join(f"  rank {rank}: {call.describe()}" for rank, call in enumerate(calls))
        raise ValueError(f"ranks issued mismatched collectives:\n{lines}")


def compute_results(calls: list[RankCall]) -> list[list[torch.Tensor]]:
    """Per rank, the tensors that rank's ``outputs`` must receive (element order, same dtype)."""
    check_calls_match(calls)
    _synchronize_cuda([t for call in calls for t in call.inputs])
    with torch.no_grad():
        results = _COMPUTE[calls[0].op](calls)
    _synchronize_cuda([t for received in results for t in received])
    for rank, (call, received) in enumerate(zip(calls, results)):
        _check_outputs(rank, call, received)
    return results


def _synchronize_cuda(tensors: list[torch.Tensor]) -> None:
    """Wait for everything queued on the CUDA devices these tensors live on.

    Each rank thread queues work on its own current stream, and streams of different threads
    are not ordered with each other: inputs must be finished before another thread reads
    them, and results before another thread copies them. A device-wide wait is slow but
    always right, which is what a test backend needs. CPU tensors need nothing.
    """
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


def _check_outputs(rank: int, call: RankCall, received: list[torch.Tensor]) -> None:
    if len(call.outputs) != len(received):
        raise ValueError(
            f"rank {rank}: {call.method} passed {len(call.outputs)} output tensors, "
            f"the collective produces {len(received)}"
        )
    for index, (out, result) in enumerate(zip(call.outputs, received)):
        if out.numel() != result.numel() or out.dtype != result.dtype:
            raise ValueError(
                f"rank {rank}: {call.method} output #{index} is {out.dtype}[{out.numel()}] "
                f"but the collective produces {result.dtype}[{result.numel()}]"
            )


def write_results(call: RankCall, results: list[torch.Tensor]) -> None:
    """Copy a rank's results into its outputs; called on that rank's own thread.

    ``detach()`` keeps autograd out of it: a backend's kernel writes the buffer directly, and
    so do we, bumping the version counter without recording an in-place op in the graph.
    """
    with torch.no_grad():
        for out, result in zip(call.outputs, results):
            out.detach().copy_(result.reshape(out.shape))
    _synchronize_cuda(call.outputs)  # the results may be freed once this call returns
