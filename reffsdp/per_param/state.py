"""The state of one ``fully_shard`` call: its hooks, and the root's per-iteration duties.

[Note: root and lazy init]
The first ``fully_shard`` state to run forward becomes the root. At that moment it finds
every state in its module tree, marks them non-root, and gives them all one shared
:class:`StateContext`. The root owns the one :class:`CommContext` of its tree (streams,
in-flight reductions): it creates it here, or takes the one ``share_comm_ctx`` handed it,
and binds every group to it. A root left at the default ``reshard_after_forward=None``
keeps its parameters unsharded after forward: backward needs them at once, so resharding
would only cost another all-gather.

[Note: prefetch policy]
The core unshards whatever group it is asked to; this front end decides which. Forward:
the modules named by ``set_modules_to_forward_prefetch``. Backward: the modules named by
``set_modules_to_backward_prefetch``, or by default the group whose forward ran just before
ours this iteration (``StateContext.post_forward_order``, walked in reverse).

[Note: hook order in one iteration]
forward:  pre-forward (unshard, wait) -> module forward -> post-forward (reshard, record
          order, hook outputs for pre-backward)
backward: pre-backward on the first output gradient (unshard, prefetch the group that ran
          before us) -> module backward -> post-backward when input gradients are ready
          (reduce-scatter) -> final callback once backward is done (finish groups that
          never saw a post-backward, wait for reductions). Under manual finalization the
          caller's ``finalize_backward()`` does the finishing and waiting instead (see
          [Note: manual backward finalization] in ``finalization``).

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..core.autograd_hooks import (
    cast_floating,
    in_backward,
    map_tensors,
    queue_final_callback,
    register_post_backward,
    register_pre_backward,
)
from ..core.compile_support import install_eager_methods, run_eagerly
from ..core.param_group import ParamGroup, end_backward, finish_backward
from ..core.runtime import CommContext
from ..core.states import TrainingState
from .api import MixedPrecisionPolicy
from .finalization import AsyncFinalization

_STATE_KEY = "_reffsdp_fully_shard_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """The ``fully_shard`` state attached to ``module``, if any."""
    return module.__dict__.get(_STATE_KEY)


@dataclass
class StateContext:
    """Per-root bookkeeping shared by all states under the root."""

    all_states: list[FSDPState] = field(default_factory=list)
    comm: RootCommContext | None = None  # created by the root at lazy init
    iter_forward_root: FSDPState | None = None
    final_callback_queued: bool = False
    is_last_backward: bool = True
    post_optim_event: Any = None
    # States whose group finished forward this iteration, in order, with repeats.
    post_forward_order: list[FSDPState] = field(default_factory=list)
    # See [Note: manual backward finalization] in ``finalization``: the mode asked for, the
    # mode latched when this iteration's backward started (None: not started), and whether
    # an asynchronous finalization still waits for its handle's wait().
    manual_finalization: bool = False
    manual_finalization_active: bool | None = None
    finalization_pending: bool = False


@dataclass
class RootCommContext(CommContext):
    """A root's communication context, shared by the roots ``share_comm_ctx`` names, with
    the asynchronous finalization that still holds it (one at a time)."""

    async_finalization: AsyncFinalization | None = None


class FSDPState:
    """Hooks and root logic for the module(s) of one ``fully_shard`` call."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup | None,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_root: bool,
    ) -> None:
        self.modules = modules
        self.group = group
        self.device = device
        self.mp_policy = mp_policy
        self.auto_reshard_root = auto_reshard_root
        self.is_root: bool | None = None
        self.ctx = StateContext()
        # Set by share_comm_ctx before lazy init: the context this root adopts.
        self.shared_comm_ctx: RootCommContext | None = None
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        # Positions of this state in ``ctx.post_forward_order`` (see [Note: prefetch policy]).
        self._post_forward_indices: list[int] = []
        # Listed modules that have yet to finish this forward (see ``_pre_forward``).
        self._modules_in_forward: set[nn.Module] = set()
        self._name = f"fully_shard module ({', '.join(type(m).__name__ for m in modules)})"
        install_eager_methods(FSDPState)
        for module in modules:
            module.__dict__[_STATE_KEY] = self
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward)
            module.register_state_dict_pre_hook(self._before_state_dict)
            module.register_load_state_dict_pre_hook(self._before_state_dict)
            module.register_load_state_dict_post_hook(self._after_load_state_dict)

    def __repr__(self) -> str:
        return self._name

    # -- lazy init ----------------------------------------------------------------------

    def lazy_init(self) -> None:
        """See [Note: root and lazy init]."""
        if self.is_root is not None:
            return
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
        self.is_root = True
        for state in states[1:]:
            if state.is_root is not None:
                raise RuntimeError(
                    f"{state} already ran forward on its own; run forward through the "
                    f"root module ({type(self.modules[0]).__name__}) first"
                )
            state.is_root = False
        self.ctx.all_states = states
        for state in states:
            state.ctx = self.ctx
        self.use_comm_ctx(self.shared_comm_ctx or RootCommContext())
        if self.group is not None and self.auto_reshard_root:
            self.group.configure(reshard_after_forward=False)
        _set_root_fqns(self.modules[0], states)
        _check_no_param_in_two_groups(states)
        for state in states:
            if state.group is not None:
                state.group.lazy_init()

    def use_comm_ctx(self, comm: RootCommContext) -> None:
        """Make ``comm`` this root's communication context and bind its groups to it."""
        self.ctx.comm = comm
        for state in self.ctx.all_states:
            if state.group is not None:
                state.group.bind(comm)

    def comm_ctx_for_sharing(self) -> RootCommContext:
        """This root's context, made now if lazy init has not run (``share_comm_ctx``)."""
        if self.ctx.comm is not None:
            return self.ctx.comm
        if self.shared_comm_ctx is None:
            self.shared_comm_ctx = RootCommContext()
        return self.shared_comm_ctx

    def adopt_comm_ctx(self, comm: RootCommContext) -> None:
        """Use another root's context (``share_comm_ctx``), now or at lazy init."""
        if self.ctx.comm is not None:
            self.use_comm_ctx(comm)
        else:
            self.shared_comm_ctx = comm

    @property
    def comm_ctx(self) -> RootCommContext:
        """The root's communication context (after lazy init)."""
        assert self.ctx.comm is not None, f"{self}: no communication context before lazy init"
        return self.ctx.comm

    def groups_under_root(self) -> list[ParamGroup]:
        """The groups of every state in this root's tree (after lazy init), pre-order."""
        return [state.group for state in self.ctx.all_states if state.group is not None]

    # -- forward hooks ------------------------------------------------------------------

    @run_eagerly  # see [Note: FSDP work runs outside compiled graphs]
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        comm = self.ctx.comm or self.shared_comm_ctx
        if self.ctx.finalization_pending or (comm is not None and comm.async_finalization):
            raise RuntimeError(
                f"{self}: forward started while an asynchronous finalize_backward is not "
                "finished; the previous gradient reduction must be waited on before forward "
                "(call wait() on the handle finalize_backward(async_op=True) returned)"
            )
        if in_backward():
            # Activation-checkpoint recompute: make sure parameters are there, nothing more.
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        self.lazy_init()
        if self.ctx.iter_forward_root is None:
            self.ctx.iter_forward_root = self
            args, kwargs = self._root_pre_forward(args, kwargs)
        self.training_state = TrainingState.FORWARD
        args, kwargs = self._cast_inputs(args, kwargs)
        if self.group is not None:
            for param in self.group.members:
                param.check_registered()
            # See [Note: grouped fully_shard].
            entering_group = not self._modules_in_forward
            if entering_group:
                self._modules_in_forward.update(self.modules)
            self.group.pre_forward()
            if entering_group:
                args, kwargs = register_post_backward(self.group.post_backward, args, kwargs)
        for target in self.forward_prefetch:
            if target.group is not None:
                target.group.unshard()
        return args, kwargs

    @run_eagerly  # see [Note: FSDP work runs outside compiled graphs]
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():
            return self._cast_output(output)
        if self.group is not None and module in self._modules_in_forward:
            self._modules_in_forward.discard(module)
            if not self._modules_in_forward:
                self._group_post_forward()
        output = register_pre_backward(self._pre_backward, output, owner=self._name)
        self.training_state = TrainingState.IDLE
        if self.ctx.iter_forward_root is self:
            self._finish_forward_root()
        return self._cast_output(output)

    def _group_post_forward(self) -> None:
        assert self.group is not None
        backward_follows = torch.is_grad_enabled()
        self.group.post_forward(backward_follows=backward_follows)
        if backward_follows:  # record the order backward prefetching walks
            self._post_forward_indices.append(len(self.ctx.post_forward_order))
            self.ctx.post_forward_order.append(self)

    def _root_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        # The optimizer step that updated the shards must finish before all-gathers read
        # them (see [Note: why all-gathers get their own stream]).
        event, self.ctx.post_optim_event = self.ctx.post_optim_event, None
        self.comm_ctx.all_gather_stream(self.device).wait_for_compute(event)
        if self.device.type == "cpu":
            return args, kwargs
        return map_tensors(lambda t: t.to(self.device, non_blocking=True), (args, kwargs))

    def _finish_forward_root(self) -> None:
        """Complete grouped states whose listed modules did not all run."""
        for state in self.ctx.all_states:
            if state._modules_in_forward:
                state._modules_in_forward.clear()
                state._group_post_forward()
                state.training_state = TrainingState.IDLE
        self.ctx.iter_forward_root = None

    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        dtype = self.mp_policy.param_dtype
        if not self.mp_policy.cast_forward_inputs or dtype is None:
            return args, kwargs
        return cast_floating((args, kwargs), dtype)

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output
        return cast_floating(output, dtype)

    # -- state dict hooks ---------------------------------------------------------------

    def _before_state_dict(self, *args: Any) -> None:
        # Saving or loading always sees the sharded DTensors, even between a forward with
        # reshard_after_forward=False and its backward.
        if self.group is not None:
            self.group.reshard()

    def _after_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        # load_state_dict(assign=True) registers new DTensors: adopt them and re-pad (see
        # [Note: replaced parameters] in reffsdp/per_param/sharded_param.py).
        if self.group is not None:
            for param in self.group.members:
                param.reset_sharded_param(loading=True)

    # -- backward hooks -----------------------------------------------------------------

    @run_eagerly  # see [Note: FSDP work runs outside compiled graphs]
    def _pre_backward(self, grad: torch.Tensor) -> None:
        self.training_state = TrainingState.PRE_BACKWARD
        if not self.ctx.final_callback_queued:
            self.ctx.final_callback_queued = True
            # Rule 1 of [Note: manual backward finalization] in ``finalization``.
            if self.ctx.manual_finalization_active is None:
                self.ctx.manual_finalization_active = self.ctx.manual_finalization
            root = self.ctx.all_states[0] if self.ctx.all_states else self
            queue_final_callback(root._final_callback)
        group = self.group
        if group is None or group.training_state is TrainingState.PRE_BACKWARD:
            return
        group.pre_backward()
        targets = self.backward_prefetch or self._previous_in_forward()
        for target in targets:
            if target.group is not None and target.group.settings.unshard_in_backward:
                target.group.unshard()

    def _previous_in_forward(self) -> list[FSDPState]:
        """The state whose group finished forward just before ours (default prefetch)."""
        if not self._post_forward_indices:
            return []
        index = self._post_forward_indices.pop()
        return [self.ctx.post_forward_order[index - 1]] if index > 0 else []

    @run_eagerly  # see [Note: FSDP work runs outside compiled graphs]
    def _final_callback(self) -> None:
        """Runs once per backward, on the root: see [Note: hook order in one iteration]."""
        ctx = self.ctx
        manual = bool(ctx.manual_finalization_active)
        try:
            # Rule 2 of [Note: manual backward finalization] in ``finalization``.
            groups = self.groups_under_root()
            end_backward(groups, self.comm_ctx, last=False, defer_reductions=manual)
            for state in ctx.all_states:
                state.training_state = TrainingState.IDLE
            if ctx.is_last_backward and not manual:
                self.end_iteration()
        finally:
            ctx.final_callback_queued = False
            ctx.iter_forward_root = None

    def end_iteration(self) -> None:
        """After the step's last backward: every reduction done, per-iteration state gone."""
        finish_backward(self.groups_under_root(), self.comm_ctx)
        for state in self.ctx.all_states:
            state._post_forward_indices.clear()
        self.ctx.post_forward_order.clear()
        self.ctx.manual_finalization_active = None

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
        for state in self.ctx.all_states:
            state.training_state = TrainingState.IDLE
            state._modules_in_forward.clear()
            state._post_forward_indices.clear()
            if state.group is not None:
                state.group.reset()
        self.ctx.iter_forward_root = None
        self.ctx.final_callback_queued = False
        self.ctx.manual_finalization_active = None
        self.ctx.finalization_pending = False
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
        for param in state.group.members if state.group is not None else ():
            for ref in param.refs:
                path = paths.get(id(ref.module))
                if path is not None:
                    param.root_fqn = f"{path}.{ref.name}" if path else ref.name
                    break


def _check_no_param_in_two_groups(states: list[FSDPState]) -> None:
    owner: dict[int, FSDPState] = {}
    for state in states:
        if state.group is None:
            continue
        for param in state.group.members:
            other = owner.setdefault(param.orig_param_uid, state)
            if other is not state:
                raise ValueError(
                    f"parameter {param.fqn!r} of {state} is already managed by another "
                    f"fully_shard group, {other}: shared (tied) parameters must be in one "
                    "group. Shard the modules that share it in one call, e.g. "
                    "fully_shard([module_a, module_b])"
                )
