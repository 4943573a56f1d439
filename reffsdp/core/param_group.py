"""A parameter group: the unit that is all-gathered and reduce-scattered together.

A group holds a list of members (see [Note: group members] in ``member``) and moves them
between their sharded and unsharded forms. Front ends decide *when* (hooks, prefetching);
the group decides *how*.

[Note: mixed precision]
At lazy init each member resolves its dtypes: ``param_dtype`` is dropped when it equals
the member's own dtype (or the member is not floating point) and ``reduce_dtype`` is
dropped when it equals the compute dtype. The all-gather input is the shard cast to the
compute dtype (a new tensor, made before copy-in), so the optimizer only ever sees the
original-dtype shards. Trainable members of one group must share their original dtype.

A member's gradient is reduced, and kept while gradient sync is off, in its ``reduce_dtype``
or else its compute dtype. Members of one group may disagree (a member that computes in its
own dtype while the others compute in ``param_dtype``): one collective carries them all, in
the promoted dtype of the members reduced (fp32 for bf16 and fp32), each gradient cast to it
first. Each member casts its reduced chunk back to its original dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import collectives, comms
from .collectives import AllGatherResult, CustomReduction, ReduceSpec
from .member import GroupMember
from .mesh import MeshInfo
from .runtime import CommContext
from .states import GROUP_SHARDING, GROUP_TRAINING, ShardedState, TrainingState, check_transition
from .streams import backend_for


@dataclass(frozen=True)
class GroupSettings:
    """Everything a user or front end may change about how a group behaves."""

    reshard_after_forward: bool = True
    reshard_after_backward: bool = True
    reduce_grads: bool = True  # reduce-scatter (and all-reduce) in this backward
    all_reduce_grads: bool = True  # HSDP: all-reduce across replicas in this backward
    unshard_in_backward: bool = True
    # Issue forward/backward all-gathers on the current stream instead of the side stream.
    unshard_async_op: bool = False
    gradient_divide_factor: float | None = None
    # Sum and divide even where the backend could average (see [Note: gradient divide
    # factors]). Both front ends use it: fully_shard's set_force_sum_reduction_for_comms,
    # and the wrapper always (torch's wrapper's numerics).
    force_sum_reduction: bool = False
    reduce_scatter_unused_params: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: Any = None
    all_gather_comm: comms.AllGather | None = None
    reduce_scatter_comm: comms.ReduceScatter | None = None
    reduce_scatter_group: dist.ProcessGroup | None = None  # None: the shard group
    # None: 1 on an accelerator, 0 on CPU (see [Note: bounded in-flight reductions]).
    max_pending_reduces: int | None = None
    # Replaces the reduce-scatter, all-reduce and divides (see [Note: custom reductions]).
    # A seam any front end may fill; today only the wrapper does, for communication hooks.
    custom_reduction: CustomReduction | None = None


class ParamGroup:
    """Unshards, reshards and reduces a list of members as one unit."""

    def __init__(
        self,
        members: list[GroupMember],
        name: str,
        mesh_info: MeshInfo,
        device: torch.device,
        *,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        settings: GroupSettings = GroupSettings(),  # noqa: B008 (frozen)
        post_forward_mesh_info: MeshInfo | None = None,
    ) -> None:
        self.members = members
        self.name = name  # for messages, given by the front end
        self.mesh_info = mesh_info
        self.device = device
        self.settings = settings
        self._mp_dtypes = (param_dtype, reduce_dtype)
        # reshard_after_forward=k: a mesh whose shard dim groups k ranks (see unshard()).
        self.post_forward_mesh_info = post_forward_mesh_info
        self.comm_ctx: CommContext | None = None  # bound by its state (see bind())
        # See [Note: state machines] in ``states``: each changes only in its _to_ method.
        self._training_state = TrainingState.IDLE
        self._sharded_state = ShardedState.SHARDED
        self._all_gather: AllGatherResult | None = None
        self._partial_reduce = collectives.PartialReduce()
        # HSDP: the last reduction issued parks its output in ``_partial_reduce`` (all-reduce
        # off), where it waits for a later backward's all-reduce.
        self._partial_reduce_pending = False
        # Gradients left to reduce (or keep) when backward is finalized: kept while
        # gradient sync was off, or left by a final callback under manual finalization.
        self._post_backward_pending = False
        self._initialized = False

    def __repr__(self) -> str:
        return f"{self.name} on rank {self.mesh_info.mesh.get_rank()}"

    def configure(self, **changes: Any) -> None:
        """Change settings by field name (``TypeError`` for a name that is no setting)."""
        self.settings = dataclasses.replace(self.settings, **changes)

    def bind(self, comm_ctx: CommContext) -> None:
        """Use this communication context (streams, in-flight reductions): its state's, and
        its root's once the root's lazy init ran (the state's driver binds it)."""
        self.comm_ctx = comm_ctx

    # -- states (see [Note: state machines] in ``states``) ------------------------------

    @property
    def training_state(self) -> TrainingState:
        return self._training_state

    def _to_training_state(self, new: TrainingState) -> None:
        """The one place a group's training state changes."""
        check_transition(GROUP_TRAINING, self._training_state, new, owner=self)
        self._training_state = new

    @property
    def sharded_state(self) -> ShardedState:
        return self._sharded_state

    def _to_sharded_state(self, new: ShardedState) -> None:
        """The one place a group's sharding changes."""
        check_transition(GROUP_SHARDING, self._sharded_state, new, owner=self)
        self._sharded_state = new

    @property
    def is_unsharded(self) -> bool:
        """Whether the parameters are unsharded for compute (a summoned group's are not)."""
        return self._sharded_state is ShardedState.UNSHARDED

    # -- lazy init ----------------------------------------------------------------------

    def lazy_init(self) -> None:
        """Once, before the first all-gather: re-sync shards and resolve mixed precision."""
        if self._initialized:
            return
        assert self.comm_ctx is not None, f"{self!r}: lazy_init() before bind()"
        for member in self.members:
            member.lazy_init(*self._mp_dtypes)
        meta = [m.fqn for m in self.members if not m.is_materialized]
        if meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {meta} ({self.name}, at its "
                "first forward). Materialize them first, e.g. module.to_empty(device=...) "
                "followed by reset_parameters() on each module."
            )
        orig_dtypes = {m.orig_dtype for m in self.members if m.requires_grad}
        if len(orig_dtypes) > 1:
            raise AssertionError(
                f"{self.name}: trainable parameters of one group must share orig_dtype, "
                f"got {sorted(map(str, orig_dtypes))}; put them in separate groups"
            )
        self._initialized = True

    # -- unshard / reshard --------------------------------------------------------------

    def unshard(self, *, async_op: bool = False, after_compute: bool = False) -> None:
        """Start the group's all-gather unless it is unsharded or already gathering.

        On CPU the collective completes before this returns unless ``async_op`` is set (see
        [Note: collectives on CPU] in ``streams``); on an accelerator the host never waits.
        ``after_compute``: called outside the forward's order (an explicit ``unshard()``,
        summoning full parameters, loading a state dict), when the compute stream may have
        just written the shards, so the side stream waits for it first (rule 1); so it does
        when a member wrote its shard in ``before_unshard``.
        """
        if self._all_gather is not None or self.is_unsharded:
            return
        self.lazy_init()
        assert self.comm_ctx is not None
        wrote = [member.before_unshard() for member in self.members]
        post_forward = self.sharded_state is ShardedState.SHARDED_POST_FORWARD
        mesh_info = self.post_forward_mesh_info if post_forward else self.mesh_info
        assert mesh_info is not None
        stream = self.comm_ctx.all_gather_stream(self.device)
        if post_forward or after_compute or any(wrote):
            stream.wait_for_compute()  # rule 1 (the post-forward blocks were cloned there)
        current = self.settings.unshard_async_op
        with stream.issuing(current=current):
            if post_forward:
                inputs = [m.post_forward_all_gather_input() for m in self.members]
            else:
                inputs = [t for m in self.members for t in m.all_gather_inputs()]
            on_compute_stream = stream.on_compute_stream(current)
            self._all_gather = collectives.foreach_all_gather(
                inputs,
                mesh_info.shard_group,
                mesh_info.shard_size,
                mesh_info.shard_rank,
                async_op=True,
                comm=self.settings.all_gather_comm,
                output=self._output_to_gather_into(inputs, on_compute_stream),
            )
            self._all_gather.event = stream.record()
        if backend_for(self.device).runs_inline and not async_op:
            self._all_gather.wait()

    def _output_to_gather_into(
        self, inputs: list[torch.Tensor], on_compute_stream: bool
    ) -> torch.Tensor | None:
        """The one member's output buffer, to all-gather into without copies, or ``None``.

        Only a group of one member with one input, with no custom all-gather (which
        allocates its own buffer), gathering on the compute stream: a member's buffer lives
        on the compute stream, and a side stream writing into it could race with compute
        still reading its memory (see [Note: why all-gathers get their own stream] in
        ``streams``).
        """
        if len(self.members) != 1 or len(inputs) != 1 or not on_compute_stream:
            return None
        if self.settings.all_gather_comm is not None:
            return None
        (output,) = self.members[0].all_gather_outputs()
        return output

    def wait_for_unshard(self) -> None:
        """Finish a started all-gather and show the unsharded parameters."""
        if self._all_gather is None:
            return
        self._finish_all_gather()
        self._show_unsharded()

    def unshard_and_show(self, *, after_compute: bool = False) -> None:
        """Unshard (unless unsharded), wait, and show the unsharded parameters once, whether
        or not this call gathered: what the module computes with now, in a forward or its
        recompute in backward. A member whose views autograd records makes fresh ones here
        (see ``to_unsharded`` in [Note: group members]). ``after_compute`` as for
        :meth:`unshard`."""
        self.unshard(after_compute=after_compute)
        if self._all_gather is not None:
            self._finish_all_gather()
        self._show_unsharded()

    def _finish_all_gather(self) -> None:
        self._copy_out_all_gather()
        self._to_sharded_state(ShardedState.UNSHARDED)

    def _copy_out_all_gather(self) -> None:
        assert self._all_gather is not None and self.comm_ctx is not None
        result, self._all_gather = self._all_gather, None
        collectives.foreach_all_gather_copy_out(result, self.members)
        if not result.in_place:  # a member's own buffer stays with the member
            self.comm_ctx.all_gather_stream(self.device).consumed(result.output)

    def _show_unsharded(self) -> None:
        for member in self.members:
            member.to_unsharded()

    def reshard(self) -> None:
        """Show the sharded parameters and free the unsharded storage."""
        self._drop_unconsumed_all_gather()
        if self.sharded_state is ShardedState.SHARDED:
            return
        for member in self.members:
            member.to_sharded()
        self._to_sharded_state(ShardedState.SHARDED)

    def _reshard_post_forward(self) -> None:
        if not self.is_unsharded:
            return
        info = self.post_forward_mesh_info
        assert info is not None
        for member in self.members:
            member.to_sharded_post_forward(info.shard_rank, info.shard_size)
        self._to_sharded_state(ShardedState.SHARDED_POST_FORWARD)

    @contextlib.contextmanager
    def unsharded_in_full_precision(self) -> Iterator[None]:
        """Show the parameters unsharded in their original dtype for the duration (the
        group is ``SUMMONED``: rule 5 of [Note: state machines] in ``states``), then go back
        to where it was: the full values a user or a state dict reads and writes outside
        forward and backward (the wrapper's ``summon_full_params`` and full state dicts).

        A member that computes in a lower ``param_dtype`` gathers in its original dtype
        into buffers of its own (``GroupMember.in_orig_dtype``): its compute-dtype buffers,
        which tensors saved for a pending backward may alias, are set aside, and on exit
        they come back, still unsharded if they were. A group already unsharded in full
        precision (kept since forward) is shown as it is and stays unsharded. Call it with
        the group idle.
        """
        self.lazy_init()
        if self._sharded_state in (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD):
            self.reshard()  # drops a compute-dtype prefetch nobody waited for
        was = self._sharded_state  # SHARDED, or UNSHARDED since forward
        self._to_sharded_state(ShardedState.SUMMONED)  # a summon in a summon stops here
        lower = [member for member in self.members if member.param_dtype is not None]
        try:
            if was is ShardedState.UNSHARDED and not lower:  # full precision already
                yield
                return
            with contextlib.ExitStack() as set_aside:
                for member in lower:
                    set_aside.enter_context(member.in_orig_dtype())
                try:
                    self.unshard(after_compute=True)  # SUMMONED is not UNSHARDED: it gathers
                    self._copy_out_all_gather()
                    self._show_unsharded()
                    yield
                finally:
                    self._drop_unconsumed_all_gather()
                    if self._sharded_state is ShardedState.SUMMONED:
                        for member in self.members:
                            member.to_sharded()  # frees the full-precision buffers
        finally:
            if self._sharded_state is ShardedState.SUMMONED:  # not ended early (rule 5)
                self._to_sharded_state(was)

    def _drop_unconsumed_all_gather(self) -> None:
        if self._all_gather is not None:  # a prefetch nobody waited for
            self._all_gather.wait()
            self._all_gather = None

    # -- forward ------------------------------------------------------------------------

    def pre_forward(self) -> None:
        self._to_training_state(TrainingState.FORWARD)
        self.unshard_and_show()

    def post_forward(self, *, backward_follows: bool = True) -> None:
        """Reshard per the settings; without a backward to come, always fully."""
        if self.settings.reshard_after_forward:
            if self.post_forward_mesh_info is not None and backward_follows:
                self._reshard_post_forward()
            else:
                self.reshard()
        self._to_training_state(TrainingState.IDLE)

    # -- backward -----------------------------------------------------------------------

    def pre_backward(self) -> None:
        """Make the parameters available for backward (no-op if already done this pass)."""
        if self._training_state is TrainingState.PRE_BACKWARD:
            return
        self._to_training_state(TrainingState.PRE_BACKWARD)
        if self.settings.unshard_in_backward:
            self.unshard()
            self.wait_for_unshard()

    @property
    def post_backward_pending(self) -> bool:
        """Whether gradients wait to be reduced (or kept) when backward is finalized."""
        return self._post_backward_pending

    @property
    def partial_reduce_pending(self) -> bool:
        """HSDP with the all-reduce off: reduced shards wait for a later all-reduce."""
        return self._partial_reduce_pending

    def post_backward(self) -> None:
        """Reduce this backward's gradients (or keep them, with gradient sync off)."""
        self._to_training_state(TrainingState.POST_BACKWARD)
        settings = self.settings
        self._post_backward_pending = not settings.reduce_grads
        if not settings.reduce_grads:
            for member in self.members:
                member.keep_unsharded_grad()
            if settings.reshard_after_backward:
                self.reshard()
            return
        members, grads = [], []
        for member in self.members:
            grad = member.take_grad_for_reduce(
                settings.reduce_scatter_unused_params and member.requires_grad
            )
            if grad is not None:
                members.append(member)
                grads.append(grad)
        if settings.reshard_after_backward:
            self.reshard()
        if members:
            assert self.comm_ctx is not None
            max_pending = settings.max_pending_reduces
            if max_pending is None:
                max_pending = 0 if backend_for(self.device).runs_inline else 1
            self.comm_ctx.make_room_for_reduce(max_pending)
            spec = self._reduce_spec(members, grads)
            if len({g.dtype for g in grads}) > 1:  # see [Note: mixed precision]
                grads[:] = [g.to(spec.reduce_dtype) for g in grads]
            self._partial_reduce_pending = self.mesh_info.has_replicate_group and not (
                spec.all_reduce or spec.custom_reduction is not None
            )
            self.comm_ctx.add_pending_reduce(
                collectives.foreach_reduce(members, grads, spec), max_pending
            )

    def _reduce_spec(self, members: list[GroupMember], grads: list[torch.Tensor]) -> ReduceSpec:
        settings = self.settings
        custom = settings.custom_reduction
        # See [Note: mixed precision]: one dtype for all, the promoted one.
        dtypes = {m.reduce_dtype or m.compute_dtype for m in members}
        reduce_dtype = functools.reduce(torch.promote_types, dtypes)
        if custom is not None and not custom.cast_to_reduce_dtype:
            reduce_dtype = grads[0].dtype
        if custom is not None:  # it divides, if at all (see [Note: custom reductions])
            plan = collectives.ReducePlan(dist.ReduceOp.SUM, dist.ReduceOp.SUM, None, None)
        else:
            plan = collectives.plan_reduction(
                self.mesh_info,
                reduce_dtype,
                divide_factor=settings.gradient_divide_factor,
                force_sum=settings.force_sum_reduction,
            )
        return ReduceSpec(
            mesh_info=self.mesh_info,
            reduce_dtype=reduce_dtype,
            plan=plan,
            partial=self._partial_reduce,
            all_reduce=settings.all_reduce_grads,
            hook=settings.all_reduce_hook,
            hook_stream=settings.all_reduce_hook_stream,
            comm=settings.reduce_scatter_comm,
            group=settings.reduce_scatter_group,
            custom_reduction=custom,
        )

    def end_backward(self, *, defer_reduction: bool = False) -> None:
        """In the final callback: reduce if backward used us but never left us, then idle.

        A group whose inputs need no gradient never sees its post-backward hook (e.g. the
        first block, or the root), yet its parameters got gradients. With
        ``defer_reduction`` (the caller finalizes backward itself) such a reduction waits
        for :meth:`finish_deferred_backward` instead, parameters still unsharded.
        """
        if self._training_state is TrainingState.PRE_BACKWARD or (
            self._training_state is TrainingState.IDLE and self.is_unsharded
        ):
            if defer_reduction and self.settings.reduce_grads:
                self._post_backward_pending = True
            else:
                self.post_backward()
        self._to_training_state(TrainingState.IDLE)

    def finish_deferred_backward(self) -> None:
        """When the caller finalizes backward: run the post-backward left pending (reduce
        per the current settings), else reshard if the settings say so; then idle."""
        if self._post_backward_pending:
            self.post_backward()
        elif self.settings.reshard_after_backward:
            self.reshard()
        self._to_training_state(TrainingState.IDLE)

    def finalize_backward(self) -> None:
        """End of the last backward: drop a prefetch that was never consumed."""
        self._drop_unconsumed_all_gather()

    def reset(self) -> None:
        """After an exception mid-iteration: back to sharded, idle, with no partial grads."""
        self.reshard()
        for member in self.members:
            member.discard_grads()
        self._partial_reduce = collectives.PartialReduce()
        self._partial_reduce_pending = False
        self._post_backward_pending = False
        self._to_training_state(TrainingState.IDLE)


def end_backward(
    groups: list[ParamGroup],
    comm_ctx: CommContext,
    *,
    last: bool = True,
    defer_reductions: bool = False,
) -> None:
    """The root's final callback, for every group under it.

    Each group reduces what backward used but never finished (or, with
    ``defer_reductions``, leaves it for the caller's finalization), then goes idle. After
    the last backward of the step (``last``), :func:`finish_backward`.
    """
    for group in groups:
        group.end_backward(defer_reduction=defer_reductions)
    if last:
        finish_backward(groups, comm_ctx)


def finish_backward(groups: list[ParamGroup], comm_ctx: CommContext) -> None:
    """End of the step's backward: wait for every reduction in flight and drop prefetches
    nobody consumed, so the optimizer sees every gradient."""
    comm_ctx.complete_reduces()
    for group in groups:
        group.finalize_backward()
