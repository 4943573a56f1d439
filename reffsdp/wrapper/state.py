"""The state of one ``FullyShardedDataParallel`` instance, below its ``nn.Module``.

[Note: the wrapper on the core]
Each instance flattens the parameters its module owns (less those of nested instances and
ignored modules) into one :class:`~reffsdp.wrapper.flat_param.FlatParamHandle`, and that
handle is the single member of one core :class:`~reffsdp.core.param_group.ParamGroup`. The
strategies are group settings: FULL_SHARD and HYBRID_SHARD reshard after forward (all but
the root) and after backward; SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 keep parameters
unsharded from forward to backward; NO_SHARD shards over one rank and all-reduces.

The hooks and their order are the core driver's (see [Note: hook order] in
``reffsdp/core/driver.py``); this state supplies what the wrapper decides:

* the tree: every instance in the root's module tree, whose groups the root first checks
  can communicate and have no parameter stepped by an optimizer in backward;
* casts: ``MixedPrecision.cast_root_forward_inputs`` for the root's inputs and
  ``cast_forward_inputs`` for every instance's, none in a recompute (torch's wrapper leaves
  checkpointed inputs as they were saved); buffers to ``buffer_dtype`` at lazy init;
* prefetch: with ``forward_prefetch`` the instance that ran next in the first iteration's
  forward; ``BACKWARD_PRE`` the instance whose forward ran before ours this iteration, in
  pre-backward; ``BACKWARD_POST`` the same one in post-backward, before the reduction. A
  group already in backward is not gathered again;
* post-backward: a hook on the unsharded flat parameter's gradient accumulation
  (``FlatParamHandle.post_backward_hook``), set once when the group is built;
* what the module shows: with ``use_orig_params`` the shard views after forward (where the
  group reshards, or no backward follows) and after backward.

[Note: an instance's state and its module]
``FullyShardedDataParallel`` is an ``nn.Module`` facade: its constructor builds a
:class:`WrapperState`, keeps it in its ``__dict__`` (:func:`state_of`) and its methods
delegate to it. The helper modules (``full_params``, ``state_dict`` and the optimizer-state
ones) take states, and find them under any module with :func:`states_under`, so none of them
imports the facade: the wrapper's modules import one another one way only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..api import BackwardPrefetch, ShardingStrategy, StateDictSettings
from ..core.driver import IterationDriver, RootContext
from ..core.mesh import MeshInfo
from ..core.param_group import GroupSettings, ParamGroup
from ..core.states import TrainingState
from ..core.torch_internals import CHECKPOINT_WRAPPED_MODULE, has_optimizer_in_backward
from . import setup
from .config import WrapperConfig
from .flat_param import FlatParamHandle, ParamSlot

STATE_KEY = "_fsdp_wrapper_state"
WRAPPED_MODULE = "_fsdp_wrapped_module"
FLAT_PARAM = "_flat_param"
RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


def state_of(module: nn.Module) -> WrapperState | None:
    """The state of ``module`` if it is a ``FullyShardedDataParallel`` instance."""
    return module.__dict__.get(STATE_KEY)


def states_under(module: nn.Module) -> list[WrapperState]:
    """The states of every instance in ``module``'s tree, pre-order (``module``'s first)."""
    return [state for sub in module.modules() if (state := state_of(sub)) is not None]


@dataclass
class WrapperRootContext(RootContext):
    """A root's shared bookkeeping, with the first iteration's pre-forward order (forward
    prefetch walks it)."""

    forward_order: list[WrapperState] = field(default_factory=list)
    forward_order_recorded: bool = False


class WrapperState(IterationDriver):
    """Everything one instance holds, and the hooks it runs (see the notes above)."""

    ctx: WrapperRootContext

    def __init__(
        self,
        module: nn.Module,
        config: WrapperConfig,
        strategy: ShardingStrategy,
        mesh_info: MeshInfo,
        device: torch.device,
        ignored: setup.Ignored,
    ) -> None:
        super().__init__(None, device, WrapperRootContext())
        self.module = module  # the FullyShardedDataParallel this is the state of
        self.config = config  # what it was built with (see [Note: the wrapper's configuration])
        # What it runs: config.sharding_strategy, but FULL_SHARD and SHARD_GRAD_OP over one
        # rank run NO_SHARD (setup.strategy_for_group).
        self.strategy = strategy
        self.mesh_info = mesh_info
        self.ignored = ignored
        self.handle: FlatParamHandle | None = None  # with the group, if any parameter is ours
        self.sync_gradients = True  # False inside no_sync()
        self.summoning = False  # inside summon_full_params (or apply) for this instance
        # See [Note: wrapper state dicts] in state_dict (state_dict.init_state_dict sets them).
        self.state_dict_settings: StateDictSettings | None = None
        self.device_mesh: Any = None  # config.device_mesh unless inherited: DTensor state dicts
        self.orig_buffer_dtypes: dict[str, torch.dtype] = {}  # before buffer_dtype casts
        self.state_dict_window: contextlib.ExitStack | None = None  # a save or load's summon

    def __repr__(self) -> str:
        return f"FullyShardedDataParallel({type(self.inner).__name__})"

    # -- what the instance wraps ----------------------------------------------------------

    @property
    def wrapped(self) -> nn.Module:
        """The registered child (an activation-checkpoint wrapper put around it since, too)."""
        return getattr(self.module, WRAPPED_MODULE)

    @property
    def inner(self) -> nn.Module:
        """The wrapped module, inside an activation-checkpoint wrapper if there is one."""
        wrapped = self.wrapped
        return getattr(wrapped, CHECKPOINT_WRAPPED_MODULE, wrapped)

    def own_modules(self) -> list[nn.Module]:
        """The modules whose parameters and buffers are this instance's: the wrapped tree
        less ignored subtrees and nested instances' trees."""
        return setup.unwrapped_modules(
            self.wrapped, self.ignored.modules, lambda sub: state_of(sub) is not None
        )

    @property
    def process_group(self) -> Any:
        """The shard group (NO_SHARD: the replicate group), as torch's wrapper names it."""
        return self.mesh_info.shard_group or self.mesh_info.replicate_group

    @property
    def rank(self) -> int:
        return self.mesh_info.shard_rank

    @property
    def world_size(self) -> int:
        return self.mesh_info.shard_size

    # -- the group ------------------------------------------------------------------------

    def build_group(self, entries: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]]):
        """Flatten ``entries`` (each parameter with every place it is registered) into this
        instance's handle, the one member of its group (see [Note: the wrapper on the core])."""
        config, mesh_info, inner = self.config, self.mesh_info, self.inner
        slots = [[ParamSlot(m, name, fqn) for m, name, fqn in refs] for _, refs in entries]
        unsharded = self.strategy is ShardingStrategy.NO_SHARD
        handle = FlatParamHandle(
            slots,
            [param for param, _ in entries],
            mesh_info.shard_size,
            mesh_info.shard_rank,
            self.device,
            config,
            fqn_prefix=f"{WRAPPED_MODULE}.",
            owner=repr(self),
            pad_multiple=mesh_info.replicate_size if unsharded else None,
        )
        handle.post_backward_hook = self._post_backward
        if config.use_orig_params:  # see [Note: names in state dicts] in state_dict
            inner.__dict__[FLAT_PARAM] = handle.flat_param
        else:
            inner.register_parameter(FLAT_PARAM, handle.flat_param)
        group_settings = GroupSettings(
            reshard_after_forward=self.strategy in RESHARD_AFTER_FORWARD,
            # Every strategy regathers after backward: the optimizer updates the shards.
            reshard_after_backward=True,
            # Torch's wrapper never reduces with AVG: it divides by the pre factor, sums,
            # and divides by the post factor (see pre_post_divide_factors). Same numerics.
            force_sum_reduction=True,
        )
        mp = config.precision
        self.handle = handle
        self.group = ParamGroup(
            [handle],
            repr(self),
            mesh_info,
            self.device,
            param_dtype=mp.param_dtype,
            # The wrapper reduces in param_dtype unless told.
            reduce_dtype=mp.reduce_dtype if mp.reduce_dtype is not None else mp.param_dtype,
            settings=group_settings,
        )

    # -- lazy init (see [Note: root and lazy init] in reffsdp/core/driver.py) -------------

    def _states_under_root(self) -> list[WrapperState]:
        states = states_under(self.module)
        _refuse_stand_in_groups(states)
        _refuse_optimizer_in_backward(states)
        return states

    @property
    def _root_keeps_unsharded(self) -> bool:
        return self.strategy in RESHARD_AFTER_FORWARD

    def _finish_lazy_init(self, states: list[IterationDriver]) -> None:
        for state in states:
            state._cast_buffers()

    def _cast_buffers(self) -> None:
        """Floating buffers of this instance's own modules to its ``buffer_dtype``: each
        instance's own setting, so batch norm wrapped with mixed precision off stays fp32
        (see [Note: mixed precision skips batch norm] in wrap.py)."""
        dtype = self.config.precision.buffer_dtype
        if dtype is None:
            return
        for sub in self.own_modules():
            for name, buffer in sub.named_buffers(recurse=False, remove_duplicate=False):
                if buffer.is_floating_point():
                    setattr(sub, name, buffer.to(dtype))

    def undo_lazy_init(self) -> None:
        """Make this root's tree un-initialized again (``apply`` needed a lazy init, but the
        forward may run from another root later)."""
        for state in states_under(self.module):
            state.is_root = None
            state.use_root_context(WrapperRootContext())
            if state.group is not None and state.strategy in RESHARD_AFTER_FORWARD:
                state.group.configure(reshard_after_forward=True)  # the root had turned it off

    # -- forward --------------------------------------------------------------------------

    def _input_dtype(self, *, root: bool = False, recompute: bool = False) -> torch.dtype | None:
        mp = self.config.precision
        if recompute or mp.param_dtype is None:
            return None
        cast = mp.cast_root_forward_inputs if root else mp.cast_forward_inputs
        return mp.param_dtype if cast else None

    def _group_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        assert self.group is not None
        self.group.pre_forward()  # fresh views, so autograd sees this forward
        if not self.ctx.forward_order_recorded:
            self.ctx.forward_order.append(self)
        return args, kwargs  # the post-backward hook sits on the handle (build_group)

    def _forward_prefetch(self) -> Iterable[ParamGroup]:
        return self._to_prefetch(self._next_in_forward()) if self.config.forward_prefetch else ()

    def _after_group_post_forward(self, backward_follows: bool) -> None:
        reshards = self.strategy in RESHARD_AFTER_FORWARD
        if self.config.use_orig_params and (reshards or not backward_follows):
            # Shard views, as torch shows: the root keeps its gathered buffer for backward,
            # and SHARD_GRAD_OP keeps the full views for backward only.
            assert self.handle is not None
            self.handle.show_sharded()

    def _end_forward_root(self) -> None:
        self.ctx.forward_order_recorded = True

    def _next_in_forward(self) -> WrapperState | None:
        order = self.ctx.forward_order
        if not self.ctx.forward_order_recorded or self not in order:
            return None
        index = order.index(self)
        return order[index + 1] if index + 1 < len(order) else None

    def _previous_in_forward(self) -> WrapperState | None:
        order = self.ctx.post_forward_order
        for index in range(len(order) - 1, -1, -1):
            if order[index] is self:
                return order[index - 1] if index > 0 else None
        return None

    @staticmethod
    def _to_prefetch(target: WrapperState | None) -> list[ParamGroup]:
        if target is None or target.group is None:
            return []
        if target.group.training_state in (
            TrainingState.PRE_BACKWARD,
            TrainingState.POST_BACKWARD,
        ):
            return []  # its backward already ran in this pass: gathering again would be waste
        return [target.group]

    # -- backward -------------------------------------------------------------------------

    def _backward_prefetch(self) -> Iterable[ParamGroup]:
        if self.config.backward_prefetch is not BackwardPrefetch.BACKWARD_PRE:
            return ()
        return self._to_prefetch(self._previous_in_forward())

    def _post_backward(self) -> None:
        """The handle's hook, once the unsharded flat parameter's gradient is accumulated."""
        assert self.group is not None
        if self.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            # Before this unit's reduction, as torch orders them: the next unit's gather is
            # not queued behind the reduce-scatter.
            for group in self._to_prefetch(self._previous_in_forward()):
                group.unshard()
        self.group.post_backward()

    def _after_backward(self) -> None:
        if self.config.use_orig_params and self.handle is not None:
            # Groups kept unsharded for the next backward (no_sync) show shards too.
            self.handle.show_sharded()


def _refuse_stand_in_groups(states: list[WrapperState]) -> None:
    """Forward, backward, summoning and state dicts communicate: a stand-in cannot."""
    for state in states:
        if isinstance(state.mesh_info.mesh, setup.StandInMesh):
            raise TypeError(
                f"{state} was built over a stand-in process group "
                f"({type(state.process_group).__name__}, with rank() and size() only), which "
                "decides sharding and wrapping but cannot communicate; build it over a "
                "torch.distributed ProcessGroup to run it"
            )


def _refuse_optimizer_in_backward(states: list[WrapperState]) -> None:
    """Parameters handed to ``torch.distributed.optim._apply_optimizer_in_backward`` are
    marked (``has_optimizer_in_backward``). On flat parameters torch's wrapper refuses them;
    on original parameters it steps them in its post-backward, which ours does not: their
    gradients are set after the reduction, so those optimizers would never step."""
    for state in states:
        handle = state.handle
        if handle is None:
            continue
        if has_optimizer_in_backward(handle.flat_param):
            raise RuntimeError(
                "FSDP optimizer in backward only supported with use_orig_params=True: the "
                f"flat parameter of {state} was given to an optimizer that steps in backward; "
                "wrap with use_orig_params=True, or step an ordinary optimizer after backward"
            )
        if any(has_optimizer_in_backward(p) for p in handle.orig_params):
            raise NotImplementedError(
                f"parameters of {state} were given to an optimizer that steps in backward, "
                "which reffsdp's wrapper does not run (torch's does with "
                "use_orig_params=True); step an ordinary optimizer after backward"
            )
