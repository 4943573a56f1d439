"""The state of one ``fully_shard`` call: its module hooks, on the core's iteration driver.

The hooks, their order and the root's duties are the core's (see [Note: root and lazy init]
and [Note: hook order] in ``reffsdp/core/driver.py``); this state supplies what
``fully_shard`` decides: the states of a tree (no grouped call as root), its casts
(``MixedPrecisionPolicy``), its prefetch targets, a grouped call's one pass per group, and
the post-backward hook on its groups' inputs. A call has one group per mesh (see [Note:
per-parameter meshes] in ``placement``); every step covers each of them.

[Note: prefetch policy]
The core unshards whatever group it is asked to; this front end decides which, once this
state's own groups are unsharded. Forward: every group of the modules named by
``set_modules_to_forward_prefetch``, in their order. Backward: every group of the modules
named by ``set_modules_to_backward_prefetch``, each module's last group first; by default,
the state whose forward ran just before ours this iteration (``RootContext.post_forward_order``,
walked in reverse), as torch picks it:

1. A state with one group prefetches that state's last group (the group that finished
   forward just before ours).
2. A state with several groups (per-parameter meshes) prefetches every group of the nearest
   *other* state before it, last group first.

(torch issues rule 2's prefetch after the second of our groups is unsharded; after all of
them here, the same moment for the two groups of a mixture-of-experts block.)

[Note: grouped fully_shard]
``fully_shard([a, b])`` gives ``a`` and ``b`` one group, gathered and reduced once per
pass. The pre-forward hook of the first listed module to run opens a group pass (gather,
and the post-backward hook on *its* inputs); the others only wait for the gather. The
pass closes when every listed module has finished forward (or, for those that never ran,
in the forward root's post-forward). Backward runs the modules in reverse, so the
post-backward on the first module's inputs fires after all of them: one reduce-scatter.
Every listed module's output carries a pre-backward hook, but the group stays in
``PRE_BACKWARD`` until that post-backward, so only the first hook to fire gathers. A
module that runs alone again after its pass closed (a chunked loss calling ``head`` per
chunk) opens a new pass and registers its own post-backward.

Under manual finalization the caller's ``finalize_backward()`` ends the iteration instead
of the final callback (see [Note: manual backward finalization] in ``finalization``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..core.autograd_hooks import register_post_backward
from ..core.driver import IterationDriver, RootContext
from ..core.param_group import ParamGroup
from ..core.runtime import CommContext
from ..core.states import TrainingState
from .api import MixedPrecisionPolicy

_STATE_KEY = "_reffsdp_fully_shard_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """The ``fully_shard`` state attached to ``module``, if any."""
    return module.__dict__.get(_STATE_KEY)


@dataclass(eq=False)
class AsyncFinalization:
    """One ``finalize_backward(async_op=True)`` whose handle has not waited yet; what to do
    with it is in ``finalization``."""

    owner: StateContext  # the context of the root that finalized


@dataclass
class RootCommContext(CommContext):
    """A root's communication context, shared by the roots ``share_comm_ctx`` names, with
    the asynchronous finalization that still holds it (one at a time; see [Note: manual
    backward finalization] in ``finalization``)."""

    async_finalization: AsyncFinalization | None = None


@dataclass
class StateContext(RootContext):
    """A root's shared bookkeeping; its communication context can hold an asynchronous
    finalization."""

    comm: RootCommContext = field(default_factory=RootCommContext)


class FSDPState(IterationDriver):
    """Hooks and root logic for the module(s) of one ``fully_shard`` call."""

    ctx: StateContext

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        groups: list[ParamGroup],
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_root: bool,
    ) -> None:
        super().__init__(groups, device, StateContext())
        self.modules = modules
        self.mp_policy = mp_policy
        self.auto_reshard_root = auto_reshard_root
        # set_allocate_memory_from_process_group_for_comm(True), which rules out symmetric
        # memory (see [Note: symmetric memory] in symm_mem).
        self.allocating_from_process_group = False
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        # Positions of this state in ``ctx.post_forward_order`` (see [Note: prefetch policy]).
        self._post_forward_indices: list[int] = []
        # Listed modules that have yet to finish this forward (see [Note: grouped fully_shard]).
        self._modules_in_forward: set[nn.Module] = set()
        self._name = f"fully_shard module ({', '.join(type(m).__name__ for m in modules)})"
        for module in modules:
            module.__dict__[_STATE_KEY] = self
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward)
            module.register_state_dict_pre_hook(self._before_state_dict)
            module.register_load_state_dict_pre_hook(self._before_state_dict)
            module.register_load_state_dict_post_hook(self._after_load_state_dict)

    def __repr__(self) -> str:
        return self._name

    # -- lazy init (see [Note: root and lazy init] in reffsdp/core/driver.py) -------------

    def _states_under_root(self) -> list[FSDPState]:
        if len(self.modules) > 1:
            raise RuntimeError(
                "a grouped fully_shard([...]) call cannot be the root: also call "
                "fully_shard on a module that contains all of them"
            )
        states = _states_under(self.modules[0])
        for state in states[1:]:
            if state.ctx.manual_finalization:
                raise RuntimeError(
                    "set_manual_backward_finalization must be called on the root FSDP "
                    f"module, {self}, but was called on {state}"
                )
        return states

    @property
    def _root_keeps_unsharded(self) -> bool:
        return self.auto_reshard_root

    def _finish_lazy_init(self, states: list[IterationDriver]) -> None:
        _set_root_fqns(self.modules[0], states)
        _check_no_param_in_two_groups(states)
        for group in self.groups_under_root():
            group.lazy_init()

    @property
    def comm_ctx(self) -> RootCommContext:
        """The communication context of this state's context (the root's after lazy init)."""
        return self.ctx.comm

    # -- forward --------------------------------------------------------------------------

    def _before_forward(self) -> None:
        if self.comm_ctx.async_finalization is not None:
            raise RuntimeError(
                f"{self}: forward started while an asynchronous finalize_backward is not "
                "finished; the previous gradient reduction must be waited on before forward "
                "(call wait() on the handle finalize_backward(async_op=True) returned)"
            )

    def _input_dtype(self, *, root: bool = False, recompute: bool = False) -> torch.dtype | None:
        if root or not self.mp_policy.cast_forward_inputs:
            return None
        return self.mp_policy.param_dtype

    def _output_dtype(self) -> torch.dtype | None:
        return self.mp_policy.output_dtype

    def _group_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        for group in self.groups:
            for param in group.members:
                param.check_registered()
        # See [Note: grouped fully_shard].
        opens_pass = not self._modules_in_forward
        if opens_pass:
            self._modules_in_forward.update(self.modules)
        for group in self.groups:
            group.pre_forward()
            if opens_pass:  # the last group's hook is outermost: backward reduces it first
                args, kwargs = register_post_backward(group.post_backward, args, kwargs)
        return args, kwargs

    def _forward_prefetch(self) -> Iterable[ParamGroup]:
        return [group for target in self.forward_prefetch for group in target.groups]

    def _leaves_group(self, module: nn.Module) -> bool:
        if module not in self._modules_in_forward:
            return False
        self._modules_in_forward.discard(module)
        return not self._modules_in_forward

    def _after_group_post_forward(self, backward_follows: bool) -> None:
        if backward_follows:  # our place in the order just recorded
            self._post_forward_indices.append(len(self.ctx.post_forward_order) - 1)

    def _end_forward_root(self) -> None:
        """Complete grouped states whose listed modules did not all run."""
        for state in self.ctx.states:
            if state._modules_in_forward:
                state._modules_in_forward.clear()
                state._group_post_forward()
                state._leave_forward()

    # -- state dict hooks -----------------------------------------------------------------

    def _before_state_dict(self, *args: Any) -> None:
        # Saving or loading always sees the sharded DTensors, even between a forward with
        # reshard_after_forward=False and its backward.
        for group in self.groups:
            group.reshard()

    def _after_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        # load_state_dict(assign=True) registers new DTensors: adopt them and re-pad (see
        # [Note: replaced parameters] in reffsdp/per_param/sharded_param.py).
        for group in self.groups:
            for param in group.members:
                param.reset_sharded_param(loading=True)

    # -- backward -------------------------------------------------------------------------

    def _backward_prefetch(self) -> Iterable[ParamGroup]:
        if self.backward_prefetch:
            targets = [g for state in self.backward_prefetch for g in reversed(state.groups)]
        else:
            targets = self._previous_in_forward()
        return [group for group in targets if group.settings.unshard_in_backward]

    def _previous_in_forward(self) -> list[ParamGroup]:
        """The groups to prefetch by default: rules 1 and 2 of [Note: prefetch policy]."""
        if not self._post_forward_indices:
            return []
        earlier = self.ctx.post_forward_order[: self._post_forward_indices.pop()]
        if len(self.groups) == 1:
            return earlier[-1].groups[-1:] if earlier else []
        others = [state for state in earlier if state is not self]
        return list(reversed(others[-1].groups)) if others else []

    def _end_iteration(self) -> None:
        self._post_forward_indices.clear()

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: back to a clean, sharded state.

        Drops an asynchronous finalization this root started (its handle's ``wait()`` then
        raises); one another root sharing the communication context started is refused.
        """
        if not self.is_root:
            raise RuntimeError("reset_iter_state() must be called on the root FSDP module")
        comm = self.comm_ctx
        if comm.async_finalization is not None and comm.async_finalization.owner is not self.ctx:
            raise RuntimeError(
                "reset_iter_state cannot reset a gradient reduction owned by another FSDP "
                "root sharing the communication context; wait on its handle or reset that root"
            )
        comm.discard_reduces()
        self.ctx.post_forward_order.clear()
        for state in self.ctx.states:
            state._to_training_state(TrainingState.IDLE)
            state._modules_in_forward.clear()
            state._post_forward_indices.clear()
            for group in state.groups:
                group.reset()
        self.ctx.iter_forward_root = None
        self.ctx.final_callback_queued = False
        self.ctx.manual_finalization_active = None
        comm.async_finalization = None


def _states_under(root: nn.Module) -> list[FSDPState]:
    """The states in ``root``'s tree, pre-order, each renamed by its modules' paths."""
    paths: dict[FSDPState, list[str]] = {}
    for path, module in root.named_modules():
        state = state_of(module)
        if state is not None:
            paths.setdefault(state, []).append(repr(path) if path else "root")
    for state, names in paths.items():
        classes = ", ".join(type(m).__name__ for m in state.modules)
        state._name = f"fully_shard module {', '.join(names)} ({classes})"
    return list(paths)


def _set_root_fqns(root: nn.Module, states: list[FSDPState]) -> None:
    """Name each sharded parameter by its FQN under the root, so errors say which it is.

    Names come from where the parameter is registered, not from what is registered there,
    so a parameter replaced before lazy init is named too.
    """
    paths = {id(module): path for path, module in root.named_modules()}
    for state in states:
        for param in (param for group in state.groups for param in group.members):
            for ref in param.refs:
                path = paths.get(id(ref.module))
                if path is not None:
                    param.root_fqn = f"{path}.{ref.name}" if path else ref.name
                    break


def _check_no_param_in_two_groups(states: list[FSDPState]) -> None:
    owner: dict[int, FSDPState] = {}
    for state in states:
        for param in (param for group in state.groups for param in group.members):
            other = owner.setdefault(param.orig_param_uid, state)
            if other is not state:
                raise ValueError(
                    f"parameter {param.fqn!r} of {state} is already managed by another "
                    f"fully_shard group, {other}: shared (tied) parameters must be in one "
                    "group. Shard the modules that share it in one call, e.g. "
                    "fully_shard([module_a, module_b])"
                )
