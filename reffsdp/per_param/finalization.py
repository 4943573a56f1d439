"""Manual backward finalization: the caller, not the end of autograd's backward, ends the
backward iteration (``FSDPModule.set_manual_backward_finalization`` / ``finalize_backward``).

[Note: manual backward finalization]
By default the root's final callback ends each backward: it reduces what backward left,
and after the last backward of a step (``set_is_last_backward``) waits for every
reduction and ends the iteration. With ``set_manual_backward_finalization(True)`` the
caller ends it instead, by calling ``finalize_backward()`` once the step's backward passes
are done (e.g. a pipeline schedule in which reducing gradients is an action of its own):

1. The mode in force is latched when a backward starts (when the final callback is
   queued, in the core driver's pre-backward: see [Note: hook order] in
   ``reffsdp/core/driver.py``) and stays until the iteration is finalized or reset.
2. Post-backward hooks reduce as usual. The final callback reduces nothing: a group that
   backward entered but never left (its inputs needed no gradient) keeps its gradients,
   unsharded, and is marked pending (the driver's final callback).
3. ``finalize_backward()`` runs each pending group's post-backward (last group first, as
   backward would) under the settings of that moment, reshards the others as
   ``reshard_after_backward`` says, then waits for every reduction and ends the iteration.
   Several backward passes may precede it, with gradient sync off for them and back on
   before it.
4. ``finalize_backward(async_op=True)`` leaves that wait to the handle it returns. Until
   ``wait()``, no root sharing the communication context may run forward or finalize;
   ``reset_iter_state()`` on the owning root drops the wait, and ``wait()`` then raises.

The state the mode needs lives on the root's ``StateContext`` (the mode asked for and the
mode latched, which the core driver reads) and, for rule 4, on the root's
``RootCommContext``, which every root sharing it sees: the asynchronous finalization not
yet waited for, with the context of the root that started it.
"""

from __future__ import annotations

from ..core.autograd_hooks import in_backward
from ..core.param_group import ParamGroup
from .state import AsyncFinalization, FSDPState


def set_mode(state: FSDPState, enabled: bool) -> None:
    """``set_manual_backward_finalization``: on the root, and not while rule 1 holds a mode."""
    ctx = state.ctx
    if state.is_root is False:
        raise RuntimeError(
            f"set_manual_backward_finalization must be called on the root FSDP module, "
            f"not on {state}"
        )
    if enabled != ctx.manual_finalization and in_backward():
        raise RuntimeError(
            "set_manual_backward_finalization cannot change mode during backward; "
            "set it before forward"
        )
    active = ctx.manual_finalization_active
    if active is not None and enabled != active:
        raise RuntimeError(
            f"set_manual_backward_finalization cannot change mode after backward starts: "
            f"this iteration's backward runs with it {'on' if active else 'off'} until "
            "the iteration is finalized (or reset_iter_state())"
        )
    ctx.manual_finalization = enabled


def finalize(state: FSDPState, *, async_op: bool) -> AsyncFinalization | None:
    """``finalize_backward``: rules 3 and 4; with ``async_op``, what the handle waits for.

    Before the root's first forward there is nothing to finalize.
    """
    if state.is_root is None:
        return None
    _check_can_finalize(state, async_op)
    for group in reversed(state.groups_under_root()):
        group.finish_deferred_backward()
    if not async_op:
        state.end_iteration()
        return None
    finalization = AsyncFinalization(state.ctx)
    state.comm_ctx.async_finalization = finalization
    return finalization


def wait(state: FSDPState, finalization: AsyncFinalization) -> None:
    """The handle's ``wait()``: finish what ``finalize_backward(async_op=True)`` began."""
    if state.comm_ctx.async_finalization is not finalization:
        raise RuntimeError(
            "This gradient reduction handle was invalidated by reset_iter_state(); its "
            "gradients were discarded"
        )
    state.end_iteration()
    state.comm_ctx.async_finalization = None


def _check_can_finalize(state: FSDPState, async_op: bool) -> None:
    """Refuse a finalization at the wrong time or place, naming what is wrong."""
    ctx, comm = state.ctx, state.comm_ctx
    held_by = comm.async_finalization
    if held_by is not None and held_by.owner is ctx:
        raise RuntimeError(
            "finalize_backward: the previous gradient reduction must be waited on before "
            "finalizing backward again (call wait() on its handle)"
        )
    if held_by is not None:
        raise RuntimeError(
            "finalize_backward: another gradient reduction sharing this communication "
            "context (share_comm_ctx) must be waited on before finalizing backward"
        )
    if not state.is_root:
        raise RuntimeError(
            f"finalize_backward must be called on the root FSDP module, not on {state}"
        )
    manual = ctx.manual_finalization_active
    if not (ctx.manual_finalization if manual is None else manual):
        raise RuntimeError(
            "FSDP finalize_backward requires manual backward finalization: call "
            "set_manual_backward_finalization(True) on the root before forward"
        )
    if ctx.final_callback_queued:
        raise RuntimeError(
            "FSDP finalize_backward must be called after backward completes, not during it"
        )
    groups = state.groups_under_root()
    _check_hsdp_groups(groups)
    if async_op:
        # The handle's wait() completes every reduction in the shared context.
        ours = {id(member) for group in groups for member in group.members}
        pending = comm.pending_reduces
        if any(id(member) not in ours for reduce in pending for member in reduce.members):
            raise RuntimeError(
                "Asynchronous gradient finalization cannot overlap reductions of another "
                "FSDP root sharing the communication context; finalize that root first"
            )


def _check_hsdp_groups(groups: list[ParamGroup]) -> None:
    """HSDP gradients must be all-reduced by a manual finalization, none left partial."""
    for group in groups:
        if group.partial_reduce_pending:
            raise RuntimeError(
                "FSDP manual backward finalization does not support partial gradient "
                f"reductions (reduce-scatter without all-reduce) for parameter group {group!r}; "
                "use automatic backward finalization for this configuration"
            )
    for group in groups:
        settings = group.settings
        if (
            group.post_backward_pending
            and settings.reduce_grads
            and group.mesh_info.has_replicate_group
            and not settings.all_reduce_grads
        ):
            raise RuntimeError(
                f"FSDP manual backward finalization requires all-reduce for parameter group "
                f"{group!r}; call set_requires_all_reduce(True) before finalization"
            )
