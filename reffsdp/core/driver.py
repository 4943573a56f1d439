"""The iteration driver: what both front ends run around a module's forward and backward.

A front end's state (one per ``fully_shard`` call, one per wrapper instance) subclasses
:class:`IterationDriver` and supplies only what differs between the APIs: how it finds the
states under a root, which dtypes inputs are cast to, which groups to prefetch, how it opens
its groups' forward and registers their post-backward, and what its module shows between
the steps. The driver decides when each step runs and in which order.

A state owns a list of groups: none (no parameters of its own), one (every wrapper
instance; a ``fully_shard`` call on one mesh), or one per mesh (a ``fully_shard`` call with
per-parameter meshes: see [Note: per-parameter meshes] in ``reffsdp/per_param/placement.py``).
Each step below runs for each of a state's groups, in their order, unless it says otherwise.

[Note: root and lazy init]
Every state is made with a :class:`RootContext` of its own, and the context with a
:class:`~reffsdp.core.runtime.CommContext` (streams, in-flight reductions); the state binds
its groups to it, so a group can gather before any root exists (an explicit ``unshard()``).
The first state to run forward becomes the root. At that moment it finds every state in its
module tree (the front end's walk, itself first), marks them non-root, and gives them all
its context (:meth:`IterationDriver.use_root_context`), so every group under the root
communicates through the root's one communication context. Only
:meth:`IterationDriver.share_comm_ctx` (behind ``share_comm_ctx`` of several roots) replaces
a context's communication context; the wrapper, undoing a lazy init, gives each state a
fresh context of its own again. A root whose front end leaves the choice to FSDP keeps its
parameters unsharded after forward: backward needs them at once, so resharding would only
cost another all-gather.

[Note: hook order]
For a root R with one non-root N inside it, one iteration runs:

forward   R pre-forward: lazy init (first iteration); as the iteration's forward root,
            rule 1 of [Note: why all-gathers get their own stream] in ``streams`` (the
            post-optimizer event, if one was given), inputs moved to the device and cast
            as root inputs; then cast as any module's inputs, R's group unsharded and
            shown, its post-backward registered, forward prefetch
          N pre-forward: the same, without the root's duties
          N post-forward: N's group resharded (per its settings), N recorded in the
            post-forward order, its outputs hooked for pre-backward, output cast
          R post-forward: the same, then the forward root's end (a front end's
            bookkeeping, e.g. groups whose modules never ran)
backward  R pre-backward (R's output gradient arrives): the final callback is queued (the
            mode of finalization latched), R's group unsharded, backward prefetch
          N pre-backward, then N post-backward once N's gradients are ready (reduce)
          R post-backward
          final callback (queued on the root, once backward is done): every group that
            backward entered but never left (its inputs needed no gradient) reduces (each
            state's groups last first, as backward runs them), all
            states idle; unless the caller finalizes backward itself (``manual_finalization``)
            or more backwards of this step follow (``is_last_backward`` False), the
            iteration ends: every reduction waited for, the post-forward order cleared
A forward run again in backward (activation-checkpoint recompute) only unshards and
shows its group and casts; its post-forward only casts the output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .autograd_hooks import (
    cast_floating,
    in_backward,
    map_tensors,
    queue_final_callback,
    register_pre_backward,
)
from .compile_support import install_eager_methods, run_eagerly
from .param_group import ParamGroup, finish_backward
from .param_group import end_backward as end_groups_backward
from .runtime import CommContext
from .states import STATE_TRAINING, TrainingState, check_transition


@dataclass
class RootContext:
    """What every state under one root shares (the root's; see [Note: root and lazy init])."""

    states: list[IterationDriver] = field(default_factory=list)  # pre-order, the root first
    # Made with the context; replaced only by IterationDriver.share_comm_ctx.
    comm: CommContext = field(default_factory=CommContext)
    iter_forward_root: IterationDriver | None = None  # the state whose forward runs outermost
    final_callback_queued: bool = False
    post_optim_event: Any = None  # what the next forward's all-gathers wait for (rule 1)
    # States whose group finished forward this iteration, in order, with repeats.
    post_forward_order: list[IterationDriver] = field(default_factory=list)
    is_last_backward: bool = True  # False: more backwards of this step follow
    # Whether the caller ends the iteration (see [Note: hook order]): asked for, and latched
    # when this iteration's backward started (None: not started).
    manual_finalization: bool = False
    manual_finalization_active: bool | None = None


class IterationDriver:
    """Hooks and root duties of one FSDP state; subclasses supply the differences."""

    def __init__(
        self, groups: list[ParamGroup] | None, device: torch.device, ctx: RootContext
    ) -> None:
        self.groups: list[ParamGroup] = list(groups or ())
        self.device = device
        self.is_root: bool | None = None  # None until a root's lazy init
        # See [Note: state machines] in ``states``: it changes only in _to_training_state.
        self._training_state = TrainingState.IDLE
        self.use_root_context(ctx)
        install_eager_methods(IterationDriver)

    @property
    def training_state(self) -> TrainingState:
        return self._training_state

    def _to_training_state(self, new: TrainingState) -> None:
        """The one place a state's training state changes (rules 1-3 of [Note: state
        machines] in ``states``)."""
        check_transition(STATE_TRAINING, self._training_state, new, owner=self)
        self._training_state = new

    def _leave_forward(self) -> None:
        """FORWARD -> IDLE. Idle already: a forward of this state nested in this one ended
        first. Any other state: this forward ran again in backward and leaves it alone."""
        if self._training_state is TrainingState.FORWARD:
            self._to_training_state(TrainingState.IDLE)

    @property
    def group(self) -> ParamGroup | None:
        """The state's one group, or ``None``: for states that have at most one (every
        wrapper instance). A state with several groups refuses, naming them."""
        if len(self.groups) > 1:
            raise RuntimeError(
                f"{self} has {len(self.groups)} parameter groups, one per mesh "
                f"({', '.join(g.name for g in self.groups)}); use its groups"
            )
        return self.groups[0] if self.groups else None

    @group.setter
    def group(self, group: ParamGroup | None) -> None:
        self.groups = [group] if group is not None else []
        if group is not None:
            group.bind(self.ctx.comm)

    # -- what a front end supplies --------------------------------------------------------

    def _states_under_root(self) -> list[IterationDriver]:
        """The states in this root's tree, pre-order, this one first; refuse a tree that
        cannot run from here."""
        raise NotImplementedError

    @property
    def _root_keeps_unsharded(self) -> bool:
        """As the root: keep the parameters unsharded after forward (FSDP's choice to make)."""
        raise NotImplementedError

    def _finish_lazy_init(self, states: list[IterationDriver]) -> None:
        """The front end's part of the root's lazy init, after the tree is joined."""

    def _before_forward(self) -> None:
        """Refuse a forward the front end cannot run now (before anything else)."""

    def _input_dtype(self, *, root: bool = False, recompute: bool = False) -> torch.dtype | None:
        """The dtype floating-point inputs are cast to: as the root's (``root``), as any
        module's, or in a recompute in backward (``recompute``); ``None``: as they are."""
        raise NotImplementedError

    def _output_dtype(self) -> torch.dtype | None:
        """The dtype floating-point outputs are cast to (``None``: as they are)."""
        return None

    def _group_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Unshard and show the groups for ``module``'s forward and register their
        post-backward; returns the inputs to run with."""
        raise NotImplementedError

    def _leaves_group(self, module: nn.Module) -> bool:
        """Whether ``module``'s forward ending ends the groups' forward."""
        return True

    def _after_group_post_forward(self, backward_follows: bool) -> None:
        """After the groups' post-forward (what the module shows, prefetch bookkeeping)."""

    def _end_forward_root(self) -> None:
        """As the iteration's forward root, when its forward ends."""

    def _forward_prefetch(self) -> Iterable[ParamGroup]:
        """Groups to start unsharding once this state's groups are unsharded for forward."""
        return ()

    def _backward_prefetch(self) -> Iterable[ParamGroup]:
        """Groups to start unsharding once this state's groups are unsharded for backward."""
        return ()

    def _after_backward(self) -> None:
        """In the final callback, once this state is idle again."""

    def _end_iteration(self) -> None:
        """When the iteration ends, per state: drop per-iteration bookkeeping."""

    # -- lazy init ------------------------------------------------------------------------

    def lazy_init(self) -> None:
        """See [Note: root and lazy init]."""
        if self.is_root is not None:
            return
        states = self._states_under_root()
        self.is_root = True
        for state in states[1:]:
            if state.is_root is not None:
                raise RuntimeError(
                    f"{state} already ran forward on its own; run forward through the root "
                    f"module ({self}) first"
                )
            state.is_root = False
        self.ctx.states = states
        for state in states:
            state.use_root_context(self.ctx)
        if self._root_keeps_unsharded:
            for group in self.groups:
                group.configure(reshard_after_forward=False)
        self._finish_lazy_init(states)

    def use_root_context(self, ctx: RootContext) -> None:
        """Join ``ctx`` (a root's at its lazy init, or a fresh one of this state's own): its
        bookkeeping, and its communication context for this state's groups."""
        self.ctx = ctx
        for group in self.groups:
            group.bind(ctx.comm)

    def share_comm_ctx(self, comm: CommContext) -> None:
        """Communicate through ``comm`` (another root's) from now on: every group sharing
        this state's context, or this state's own before lazy init. The one place a
        context's communication context is replaced (see [Note: root and lazy init])."""
        self.ctx.comm = comm
        for state in self.ctx.states or [self]:
            for group in state.groups:
                group.bind(comm)

    @property
    def comm_ctx(self) -> CommContext:
        """The communication context of this state's context (the root's after lazy init)."""
        return self.ctx.comm

    def groups_under_root(self) -> list[ParamGroup]:
        """The groups of every state in this root's tree (after lazy init), pre-order, each
        state's in its order."""
        return [group for state in self.ctx.states for group in state.groups]

    # -- forward --------------------------------------------------------------------------

    @run_eagerly  # see [Note: FSDP work runs outside compiled graphs]
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self._before_forward()
        if in_backward():  # activation-checkpoint recompute: the parameters, nothing more
            for group in self.groups:
                group.unshard_and_show()
            return self._cast(self._input_dtype(recompute=True), (args, kwargs))
        self.lazy_init()
        if self.ctx.iter_forward_root is None:
            self.ctx.iter_forward_root = self
            args, kwargs = self._root_pre_forward(args, kwargs)
        self._to_training_state(TrainingState.FORWARD)
        args, kwargs = self._cast(self._input_dtype(), (args, kwargs))
        if self.groups:
            args, kwargs = self._group_pre_forward(module, args, kwargs)
        for group in self._forward_prefetch():
            group.unshard()
        return args, kwargs

    def _root_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        # Rule 1 of [Note: why all-gathers get their own stream]: the optimizer step that
        # updated the shards finishes before all-gathers read them (only the event, if the
        # caller gave one).
        event, self.ctx.post_optim_event = self.ctx.post_optim_event, None
        self.comm_ctx.all_gather_stream(self.device).wait_for_compute(event)
        if self.device.type != "cpu":
            move = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
            args, kwargs = map_tensors(move, (args, kwargs))
        if not self.is_root:  # a non-root run on its own casts as any module
            return args, kwargs
        return self._cast(self._input_dtype(root=True), (args, kwargs))

    @staticmethod
    def _cast(dtype: torch.dtype | None, tree: Any) -> Any:
        return tree if dtype is None else cast_floating(tree, dtype)

    @run_eagerly  # see [Note: FSDP work runs outside compiled graphs]
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            return self._cast(self._output_dtype(), output)
        if self.groups and self._leaves_group(module):
            self._group_post_forward()
        output = register_pre_backward(self._pre_backward, output, owner=repr(self))
        self._leave_forward()
        if self.ctx.iter_forward_root is self:
            self._end_forward_root()
            self.ctx.iter_forward_root = None
        return self._cast(self._output_dtype(), output)

    def _group_post_forward(self) -> None:
        backward_follows = torch.is_grad_enabled()
        for group in self.groups:
            group.post_forward(backward_follows=backward_follows)
        if backward_follows:  # the order backward prefetching walks
            self.ctx.post_forward_order.append(self)
        self._after_group_post_forward(backward_follows)

    # -- backward -------------------------------------------------------------------------

    @run_eagerly  # see [Note: FSDP work runs outside compiled graphs]
    def _pre_backward(self, grad: torch.Tensor) -> None:
        self._to_training_state(TrainingState.PRE_BACKWARD)
        ctx = self.ctx
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            if ctx.manual_finalization_active is None:  # latched until the iteration ends
                ctx.manual_finalization_active = ctx.manual_finalization
            root = ctx.states[0] if ctx.states else self
            queue_final_callback(root._final_callback)
        entering = [g for g in self.groups if g.training_state is not TrainingState.PRE_BACKWARD]
        if not entering:  # another output's hook of this pass got here first
            return
        for group in entering:
            group.pre_backward()
        for target in self._backward_prefetch():
            target.unshard()

    @run_eagerly  # see [Note: FSDP work runs outside compiled graphs]
    def _final_callback(self) -> None:
        """Runs once per backward, on the root: see [Note: hook order]."""
        ctx = self.ctx
        manual = bool(ctx.manual_finalization_active)
        try:
            # Each state's groups last first, as backward reduces them.
            groups = [group for state in ctx.states for group in reversed(state.groups)]
            end_groups_backward(groups, self.comm_ctx, last=False, defer_reductions=manual)
            for state in ctx.states:
                state._to_training_state(TrainingState.IDLE)
                state._after_backward()
            if ctx.is_last_backward and not manual:
                self.end_iteration()
        finally:
            ctx.final_callback_queued = False
            ctx.iter_forward_root = None

    def end_iteration(self) -> None:
        """After the step's last backward: every reduction done, per-iteration state gone."""
        finish_backward(self.groups_under_root(), self.comm_ctx)
        for state in self.ctx.states:
            state._end_iteration()
        self.ctx.post_forward_order.clear()
        self.ctx.manual_finalization_active = None
