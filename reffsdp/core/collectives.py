"""Group collectives: one all-gather and one reduce-scatter for a whole parameter group.

[Note: one collective per group]
Launching one collective per parameter wastes latency, so a group's parameters travel
together. For the all-gather, each rank copies its padded shards into its own slice of one
flat output buffer (copy-in) and gathers in place; afterwards each parameter's rows are
split out of the ``(world_size, N)`` result into its own output buffer (copy-out).
For the reduce-scatter, every gradient is padded on dim 0 to a multiple of the world size,
cut into ``world_size`` chunks, and the chunks for rank r of every gradient are laid side
by side in row r of one input buffer; the reduced row r comes back to rank r, which then
hands each member its ``shard_numel`` elements at a running offset.

Two ranks, params ``a`` (3 rows) and ``b`` (2 rows), one element per row::

    reduce-scatter input, row 0: [a0 a1 | b0]      row 1: [a2 pad | b1]
    rank 0 receives sum of row 0 -> grad shards a[0:2], b[0:1]

A member may offer several all-gather inputs (a parameter whose tensor subclass gathers
itself, e.g. fp8 data and a scale: [Note: all-gather extensions] in
``reffsdp/per_param/extensions.py``); each is one more column block of the row, with an
output of its own. When the inputs of a group differ in dtype, the collective moves raw
bytes: every input is viewed as ``uint8`` for copy-in and every output for copy-out.

A group of one member (a wrapper instance's flat parameter, or a lone parameter) needs
neither copy: its shard is the whole of row r, so the group may pass the member's own
output buffer as ``output`` and the collective gathers the shard straight into it. Its
gradient, when it needs no padding or cast, is already the reduce-scatter input.

[Note: gradient divide factors]
Data parallelism averages gradients over ``dp = shard_size * replicate_size`` ranks. When
the reduce dtype cannot overflow (fp32, bf16) and the backend supports it we let the
collective average (``AVG``), or pre-multiply by ``1/f`` (``PREMUL_SUM``) for a custom
factor ``f``. Otherwise we sum, dividing by ``pre`` before and ``post`` after the sum so
fp16 neither underflows nor overflows (see ``sharding.pre_post_divide_factors``). Backends
without ``AVG`` or ``PREMUL_SUM`` (gloo lacks ``PREMUL_SUM``) fall back to sum + divide.
With one rank per shard group the reduce-scatter is a copy, and a custom factor is applied
in that copy, as one out-of-place division (as torch's ``fully_shard`` does): the all-reduce
hook sees the divided gradient there too, whatever the backend.

[Note: custom reductions]
A front end may replace a group's whole reduction (reduce-scatter, HSDP all-reduce and
every divide) with a :class:`CustomReduction` it supplies (the wrapper does, to run a user's
communication hook; ``fully_shard`` supplies none). The core still lays the gradients out
(see [Note: one collective per group]) and still hands each member its chunk afterwards; in
between it calls the reduction at once, on the calling thread, and trusts it to leave the
data-parallel result:

* groups with a shard dimension: ``fn(grad, output)``, ``grad`` the padded input row
  buffer (1D, ``shard_size * N``) and ``output`` (1D, ``N``) this rank's chunk to fill;
* replicate-only groups (no shard dimension): ``fn(grad)``, reducing ``grad`` in place.

The function may swap a tensor's ``.data`` (say, to communicate in fp16 and cast back):
the core reads ``output`` (or ``grad``) only after the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import comms
from .member import GroupMember
from .mesh import MeshInfo
from .profiling import in_phase, phase
from .sharding import pre_post_divide_factors
from .streams import (
    backend_for,
    record_on_current_stream,
    run_on_stream,
    wait_event_on_current_stream,
)
from .torch_internals import chunk_cat, foreach_copy_, premul_sum

AVG = dist.ReduceOp.AVG

# -- all-gather ----------------------------------------------------------------------------


@dataclass
class AllGatherResult:
    """An in-flight (or finished) group all-gather."""

    output: torch.Tensor  # 1D flat, world_size * sum(input_numels) elements
    input_numels: list[int]  # per parameter, in elements of output's dtype
    world_size: int  # ranks that contributed, i.e. rows of the output
    work: dist.Work | None = None
    event: Any = None  # recorded on the all-gather stream after the collective (streams)
    in_place: bool = False  # ``output`` is the one member's buffer: no copy-out

    @in_phase("all-gather")
    def wait(self) -> None:
        """Make the current stream (and, for CPU backends, the caller) wait for the data."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        wait_event_on_current_stream(self.event, self.output.device)
        self.event = None


def foreach_all_gather(
    inputs: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    world_size: int,
    rank: int,
    *,
    async_op: bool,
    comm: comms.AllGather | None = None,
    output: torch.Tensor | None = None,
) -> AllGatherResult:
    """Copy every input (the members' inputs, in order) into this rank's slice of one buffer
    and all-gather it in place.

    With one input, ``output`` may be given: the member's own buffer, gathered into
    directly (see [Note: one collective per group]).
    """
    if output is not None:
        (shard,) = inputs
        work = None
        if world_size > 1:
            work = (comm or comms.DefaultAllGather())(output, shard, group, async_op=async_op)
        else:
            output.copy_(shard)
        work = work if async_op else None
        return AllGatherResult(output, [shard.numel()], world_size, work, in_place=True)
    if len({t.dtype for t in inputs}) > 1:
        # Mixed dtypes (a frozen non-float parameter, an fp8 extension's scales): bytes.
        inputs = [t.view(torch.uint8) for t in inputs]
    numels = [t.numel() for t in inputs]
    total = sum(numels)
    comm = comm or comms.DefaultAllGather()
    output = comm.allocate((total * world_size,), dtype=inputs[0].dtype, device=inputs[0].device)
    my_slice = output.narrow(0, total * rank, total)
    with phase("copy-in"):
        foreach_copy_(list(my_slice.split(numels)), inputs)
    work = None
    if world_size > 1:
        work = comm(output, my_slice, group, async_op=async_op)
    return AllGatherResult(output, numels, world_size, work if async_op else None)


def foreach_all_gather_copy_out(result: AllGatherResult, members: list[GroupMember]) -> None:
    """Split the gathered ``(world_size, N)`` buffer into the members' output buffers.

    Row r of ``result`` holds rank r's inputs side by side; each output buffer, viewed with
    the same number of rows, receives its input's column block.
    """
    result.wait()
    if result.in_place:
        members[0].finish_unshard()
        return
    outputs = [output for member in members for output in member.all_gather_outputs()]
    targets = [output.view(result.world_size, -1) for output in outputs]
    if result.output.dtype == torch.uint8:
        targets = [t.view(torch.uint8) for t in targets]
    rows = result.output.view(result.world_size, -1)
    with phase("copy-out"):
        torch.split_with_sizes_copy(rows, result.input_numels, dim=1, out=targets)
    for member in members:
        member.finish_unshard()


# -- reduce-scatter ------------------------------------------------------------------------


@dataclass(frozen=True)
class ReducePlan:
    """How to turn summed-or-averaged collectives into the data-parallel average."""

    reduce_scatter_op: object
    all_reduce_op: object
    pre_factor: float | None  # divide before the collective
    post_factor: float | None  # divide after the collective
    premul_factor: float | None = None  # the factor inside a PREMUL_SUM op
    copy_divisor: float | None = None  # shard size 1: the copy that stands in divides by it


def plan_reduction(
    mesh_info: MeshInfo,
    reduce_dtype: torch.dtype,
    *,
    divide_factor: float | None = None,
    force_sum: bool = False,
) -> ReducePlan:
    """Pick ops and pre/post factors per [Note: gradient divide factors]."""
    sum_op = dist.ReduceOp.SUM
    dp_size = mesh_info.shard_size * mesh_info.replicate_size
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    # Replicate only (SPMD mesh): no shard group; the all-reduce group decides support.
    group = mesh_info.shard_group
    if group is None:
        group = mesh_info.replicate_group
    if not overflow_risk and not force_sum:
        if divide_factor is None:
            if dp_size == 1:
                return ReducePlan(sum_op, sum_op, None, None)
            if comms.supports_reduce_op(group, AVG) and (
                not mesh_info.has_replicate_group
                or comms.supports_reduce_op(mesh_info.replicate_group, AVG)
            ):
                return ReducePlan(dist.ReduceOp.AVG, dist.ReduceOp.AVG, None, None)
        elif divide_factor == mesh_info.shard_size and comms.supports_reduce_op(group, AVG):
            return ReducePlan(dist.ReduceOp.AVG, sum_op, None, None)
        elif mesh_info.shard_size == 1:
            divisor = divide_factor if divide_factor != 1 else None
            return ReducePlan(sum_op, sum_op, None, None, copy_divisor=divisor)
        elif comms.supports_reduce_op(group, dist.ReduceOp.PREMUL_SUM):
            factor = 1.0 / divide_factor
            return ReducePlan(premul_sum(factor), sum_op, None, None, factor)
    factor = divide_factor if divide_factor is not None else dp_size
    if overflow_risk:
        pre, post = pre_post_divide_factors(factor)
    else:
        pre, post = 1.0, float(factor)
    return ReducePlan(
        sum_op, sum_op, pre if pre > 1 else None, post if post not in (None, 1) else None
    )


@dataclass(frozen=True)
class CustomReduction:
    """A reduction the front end supplies (see [Note: custom reductions])."""

    fn: Callable[..., None]
    # False: hand the gradients over in their own dtype, not cast to the reduce dtype first
    # (for a reduction that picks its own communication dtype).
    cast_to_reduce_dtype: bool = True


@dataclass
class PartialReduce:
    """HSDP with the all-reduce off: reduce-scatter outputs summed until it is back on."""

    tensor: torch.Tensor | None = None

    def add(self, output: torch.Tensor) -> None:
        self.tensor = output.clone() if self.tensor is None else self.tensor.add_(output)

    def fold_into(self, output: torch.Tensor) -> torch.Tensor:
        if self.tensor is not None:
            output = output.add_(self.tensor)
            self.tensor = None
        return output


@dataclass(frozen=True)
class ReduceSpec:
    """How one group reduces its gradients in one backward."""

    mesh_info: MeshInfo
    reduce_dtype: torch.dtype
    plan: ReducePlan
    partial: PartialReduce  # HSDP: where outputs wait while the all-reduce is off
    all_reduce: bool = True  # HSDP / replicate-only: all-reduce now or park in ``partial``
    hook: Callable[[torch.Tensor], None] | None = None  # on the reduced shard
    hook_stream: Any = None  # a user stream to run ``hook`` on
    comm: comms.ReduceScatter | None = None  # a custom reduce-scatter
    group: dist.ProcessGroup | None = None  # reduce-scatter group; None: the shard group
    custom_reduction: CustomReduction | None = None  # replaces the collectives and divides


@dataclass
class PendingReduce:
    """An in-flight group reduce-scatter; ``complete()`` hands members their gradients."""

    members: list[GroupMember]
    spec: ReduceSpec
    input: torch.Tensor | None  # with streams only: held until the collective finishes
    output: torch.Tensor | None  # 1D, this rank's reduced row
    work: dist.Work | None = None
    completed: bool = field(default=False)
    host_copy_event: Any = None  # CPU offload: gradients still landing on the host

    @in_phase("reduce-scatter")
    def complete(self) -> None:
        if self.completed:
            return
        self.completed = True
        self.wait()
        output, spec = self.output, self.spec
        self.input = self.output = None
        assert output is not None
        if spec.mesh_info.has_replicate_group and spec.custom_reduction is None:
            if not spec.all_reduce:
                spec.partial.add(output)
                return
            output = spec.partial.fold_into(output)
            comms.all_reduce(output, spec.mesh_info.replicate_group, op=spec.plan.all_reduce_op)
        if spec.hook is not None:
            run_on_stream(spec.hook_stream, spec.hook, output)
        if spec.plan.post_factor is not None:
            output.div_(spec.plan.post_factor)
        if _hand_out_grads(self.members, output):
            # Non-blocking device-to-host gradient copies: the final callback waits for this
            # event before anyone (the optimizer, on the CPU) reads the gradients (rule 6).
            self.host_copy_event = record_on_current_stream(output.device)

    def wait(self) -> None:
        """Wait for the collective only (used to drop a reduction after an error)."""
        if self.work is not None:
            self.work.wait()
            self.work = None


def _hand_out_grads(members: list[GroupMember], output: torch.Tensor) -> bool:
    """Give each member its chunk of the reduced row (see the module note).

    Returns whether any gradient is still being copied to the host.
    """
    in_flight = False
    offset = 0
    for member in members:
        in_flight |= member.accept_reduced_grad(output.narrow(0, offset, member.shard_numel))
        offset += member.shard_numel
    return in_flight


@in_phase("reduce-scatter")
def foreach_reduce(
    members: list[GroupMember], grads: list[torch.Tensor], spec: ReduceSpec
) -> PendingReduce:
    """Reduce-scatter all ``grads`` in one collective (see [Note: one collective per group]).

    Empties ``grads``: once copied into the collective's input the unsharded gradients are
    freed, before the collective allocates anything of its own.
    """
    world_size = spec.mesh_info.shard_size
    shard_numel = sum(m.shard_numel for m in members)
    comm = spec.comm or comms.DefaultReduceScatter()
    rs_input = _laid_out_already(grads, world_size * shard_numel, spec)
    if rs_input is None:
        rs_input = comm.allocate(
            (world_size * shard_numel,), dtype=spec.reduce_dtype, device=grads[0].device
        )
        chunk_cat(grads, world_size, out=rs_input.view(world_size, -1))
    grads.clear()
    if spec.custom_reduction is not None:
        return _custom_reduce(members, rs_input, spec)
    plan = spec.plan
    if plan.pre_factor is not None:
        rs_input.div_(plan.pre_factor)
    if world_size == 1:
        # One rank: the reduction is the identity (AVG and SUM alike) up to a divide factor.
        output = rs_input if plan.copy_divisor is None else rs_input / plan.copy_divisor
        return PendingReduce(members, spec, input=rs_input, output=output)
    output = rs_input.new_empty(shard_numel)
    group = spec.group if spec.group is not None else spec.mesh_info.shard_group
    work = comm(output, rs_input, group, plan.reduce_scatter_op, async_op=True)
    return PendingReduce(members, spec, input=_held_input(rs_input), output=output, work=work)


def _held_input(rs_input: torch.Tensor) -> torch.Tensor | None:
    """What a pending reduce-scatter holds of its input until it completes.

    With streams (CUDA) the caching allocator could hand the input's memory to the next
    allocation on the compute stream while the backend's stream still reads it: we hold it
    (rule 5 of [Note: why all-gathers get their own stream] in ``streams``). On CPU a backend
    holds its own reference for as long as it reads a tensor (gloo even copies the input at
    issue), so ours would only raise the peak.
    """
    return None if backend_for(rs_input.device).runs_inline else rs_input


def _laid_out_already(
    grads: list[torch.Tensor], numel: int, spec: ReduceSpec
) -> torch.Tensor | None:
    """The one gradient itself, flattened, when it already is the reduce-scatter input.

    A group of one member whose gradient needs no padding, no cast and no pre-divide has
    exactly the layout of [Note: one collective per group]: row r is its chunk r. The
    gradient was taken from the member, so nobody else reads it; a custom reduce-scatter
    or reduction allocates (or may rewrite) its own buffer and still gets a copy.
    """
    if len(grads) != 1 or spec.comm is not None or spec.custom_reduction is not None:
        return None
    (grad,) = grads
    if spec.plan.pre_factor is not None or spec.mesh_info.shard_size == 1:
        return None
    if grad.numel() != numel or grad.dtype != spec.reduce_dtype or not grad.is_contiguous():
        return None
    return grad.view(-1)


def _custom_reduce(
    members: list[GroupMember], grad: torch.Tensor, spec: ReduceSpec
) -> PendingReduce:
    """Run the front end's reduction now (see [Note: custom reductions])."""
    assert spec.custom_reduction is not None
    if spec.mesh_info.shard_mesh_dim is None:
        spec.custom_reduction.fn(grad)
        return PendingReduce(members, spec, input=None, output=grad)
    output = grad.new_empty(grad.numel() // spec.mesh_info.shard_size)
    spec.custom_reduction.fn(grad, output)
    return PendingReduce(members, spec, input=grad, output=output)
