"""``FullyShardedDataParallel``: the wrapper API, a thin front end on the shared core.

[Note: the wrapper on the core]
Each instance flattens the parameters its module owns (less those of nested instances and
ignored modules) into one :class:`~reffsdp.wrapper.flat_param.FlatParamHandle`, and that
handle is the single member of one core :class:`~reffsdp.core.param_group.ParamGroup`. The
strategies are group settings: FULL_SHARD and HYBRID_SHARD reshard after forward (all but
the root) and after backward; SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 keep parameters
unsharded from forward to backward; NO_SHARD shards over one rank and all-reduces. This
module only decides *when* groups unshard, reshard and reduce:

forward:  root: lazy init, wait for the optimizer, move and cast inputs
          instance: unshard + wait, show views, forward prefetch, module forward,
          reshard per strategy, hook the outputs for pre-backward
backward: pre-backward (first output gradient): unshard, BACKWARD_PRE prefetch
          post-backward (the flat gradient is accumulated): reduce, BACKWARD_POST prefetch
          final callback (root): reduce what never saw a post-backward, wait for reductions
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..algorithms import LOW_PRECISION_HOOKS
from ..api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from ..core.autograd_hooks import (
    cast_floating,
    in_backward,
    map_tensors,
    queue_final_callback,
    register_pre_backward,
)
from ..core.collectives import CustomReduction
from ..core.compile_support import install_eager_methods, mark_fsdp_managed, run_eagerly
from ..core.param_group import GroupSettings, ParamGroup, end_backward
from ..core.runtime import CommContext
from ..core.states import TrainingState
from ..core.torch_internals import (
    CHECKPOINT_WRAPPED_MODULE,
    has_optimizer_in_backward,
    registered_children,
    registered_parameters,
)
from . import full_params, legacy_optim_state, optim_state, optim_state_load, setup, state_dict
from .compile_support import call_through_wrappers, run_frame_eagerly
from .flat_param import FlatParameter, FlatParamHandle, ParamSlot

WRAPPED_MODULE = "_fsdp_wrapped_module"
FLAT_PARAM = "_flat_param"
_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


@dataclass
class RootContext:
    """What every instance under one root shares."""

    instances: list[FullyShardedDataParallel] = field(default_factory=list)
    comm: CommContext = field(default_factory=CommContext)
    iter_forward_root: FullyShardedDataParallel | None = None
    final_callback_queued: bool = False
    # First iteration's pre-forward order (forward prefetch) and this iteration's
    # post-forward order (backward prefetch).
    forward_order: list[FullyShardedDataParallel] = field(default_factory=list)
    forward_order_recorded: bool = False
    post_forward_order: list[FullyShardedDataParallel] = field(default_factory=list)


class FullyShardedDataParallel(nn.Module):
    """Shards a module's parameters across data-parallel ranks (the wrapper API)."""

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Any = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Any = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__()
        setup.check_arguments(
            module,
            FullyShardedDataParallel,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            process_group=process_group,
            param_init_fn=param_init_fn,
        )
        setup.check_hybrid_groups(sharding_strategy, process_group, device_mesh, auto_wrap_policy)
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        device = setup.compute_device(module, device_id, process_group, device_mesh)
        mesh_info = setup.mesh_info_for_strategy(strategy, process_group, device_mesh, device)
        self.sharding_strategy = setup.strategy_for_group(strategy, mesh_info)
        if self.sharding_strategy is not strategy:
            mesh_info = setup.mesh_info_for_strategy(
                self.sharding_strategy, process_group, device_mesh, device
            )
        ignored_modules_set, ignored_params = setup.ignored_sets(
            module, ignored_modules, ignored_states, FullyShardedDataParallel
        )
        mark_fsdp_managed(
            (m for m in module.modules() if m not in ignored_modules_set),
            params_are_own=use_orig_params,
        )
        install_eager_methods(FullyShardedDataParallel)
        if auto_wrap_policy is not None:
            from ..wrap import auto_wrap_children

            # Children reuse the root's groups: a hybrid mesh is built once, here.
            hybrid = strategy in setup.HYBRID
            root_kwargs = dict(
                process_group=None if hybrid else process_group,
                sharding_strategy=strategy,
                cpu_offload=cpu_offload,
                backward_prefetch=backward_prefetch,
                mixed_precision=mixed_precision,
                param_init_fn=param_init_fn,
                device_id=device_id,
                sync_module_states=sync_module_states,
                forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers,
                use_orig_params=use_orig_params,
                # Ignored parameters stay ignored inside the children that hold them.
                ignored_states=ignored_params or None,
                device_mesh=mesh_info.mesh if hybrid else device_mesh,
            )
            auto_wrap_children(
                module,
                auto_wrap_policy,
                FullyShardedDataParallel,
                root_kwargs,
                ignored_modules_set,
                ignored_params,
            )
            call_through_wrappers(module, FullyShardedDataParallel)
        self.cpu_offload = cpu_offload or CPUOffload()
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        # torch's rate limiter (at most two all-gathers ahead of compute) holds by construction
        # here: see rule 3 of [Note: why all-gathers get their own stream] in core/streams.
        self.limit_all_gathers = limit_all_gathers
        # None reads as all-default settings (full precision), as torch's wrapper keeps it.
        self.mixed_precision = mixed_precision if mixed_precision is not None else MixedPrecision()
        self._use_orig_params = use_orig_params
        self.compute_device = device
        self.process_group = mesh_info.shard_group or mesh_info.replicate_group
        self.rank = mesh_info.shard_rank
        self.world_size = mesh_info.shard_size
        self._mesh_info = mesh_info
        self._ignored_modules = ignored_modules_set
        self._ignored_params = ignored_params
        self._is_root: bool | None = None
        self._sync_gradients = True
        self._root_ctx = RootContext()
        self.training_state = TrainingState.IDLE
        self.add_module(WRAPPED_MODULE, module)
        state_dict.init_state_dict(self, device_mesh)

        setup.materialize(
            module, param_init_fn, device, ignored_modules_set, FullyShardedDataParallel
        )
        own_modules = setup._unwrapped_modules(
            module, ignored_modules_set, FullyShardedDataParallel
        )
        offload = self.cpu_offload.offload_params
        setup.move_to_device(own_modules, device, offload, FullyShardedDataParallel)
        entries = setup.managed_params(
            module, ignored_modules_set, ignored_params, FullyShardedDataParallel, FLAT_PARAM
        )
        if sync_module_states:
            buffers = [b for m in own_modules for b in m.buffers(recurse=False)]
            setup.sync_module_states([p for p, _ in entries], buffers, mesh_info)
        self._handle: FlatParamHandle | None = None
        self._group: ParamGroup | None = None
        if entries:
            self._build_group(entries, mesh_info, device, self.sharding_strategy, offload)

    def _build_group(self, entries, mesh_info, device, strategy, offload) -> None:
        slots = [[ParamSlot(m, name, fqn) for m, name, fqn in refs] for _, refs in entries]
        unsharded = strategy is ShardingStrategy.NO_SHARD
        handle = FlatParamHandle(
            slots,
            [param for param, _ in entries],
            mesh_info.shard_size,
            mesh_info.shard_rank,
            device,
            use_orig_params=self._use_orig_params,
            offload=offload,
            fqn_prefix=f"{WRAPPED_MODULE}.",
            owner=f"FullyShardedDataParallel({type(self.module).__name__})",
            pad_multiple=mesh_info.replicate_size if unsharded else None,
        )
        handle.post_backward_hook = self._post_backward
        mp = self.mixed_precision
        handle.keep_low_precision_grads = mp.keep_low_precision_grads
        module = self.module  # inside a checkpoint wrapper: see [Note: names in state dicts]
        if self._use_orig_params:
            module.__dict__[FLAT_PARAM] = handle.flat_param
        else:
            module.register_parameter(FLAT_PARAM, handle.flat_param)
        param_dtype, reduce_dtype = mp.param_dtype, mp.reduce_dtype
        if reduce_dtype is None:
            reduce_dtype = param_dtype  # the wrapper reduces in param_dtype unless told
        settings = GroupSettings(
            reshard_after_forward=strategy in _RESHARD_AFTER_FORWARD,
            # Every strategy regathers after backward: the optimizer updates the shards.
            reshard_after_backward=True,
            # Torch's wrapper never reduces with AVG: it divides by the pre factor, sums,
            # and divides by the post factor (see pre_post_divide_factors). Same numerics.
            force_sum_reduction=True,
        )
        self._handle = handle
        self._group = ParamGroup(
            [handle],
            f"FullyShardedDataParallel({type(module).__name__})",
            mesh_info,
            device,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            settings=settings,
        )

    # -- plain accessors ----------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module (under an activation-checkpoint wrapper, the module inside)."""
        wrapped = self._fsdp_wrapped_module
        return getattr(wrapped, CHECKPOINT_WRAPPED_MODULE, wrapped)

    @property
    def _flat_param(self) -> FlatParameter | None:
        return self._handle.flat_param if self._handle is not None else None

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = registered_children(self).get(WRAPPED_MODULE)
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        """``nn.Module._apply`` (behind ``to()``, ``half()``, ``to_empty()``) with the move
        landing on the flat parameter (see [Note: moving a wrapped model] in flat_param)."""
        handle, group = self._handle, self._group
        if handle is None:
            return super()._apply(fn, recurse)
        result, moved = self._apply_to_flat_param(fn, recurse)
        if not handle.is_local_shard(moved):
            if group.training_state is not TrainingState.IDLE:
                raise RuntimeError(
                    f"{group.name} cannot move its parameters in "
                    f"{group.training_state.name}; move the model between iterations"
                )
            group.reshard()  # buffers gathered in the old dtype go
            handle.follow_flat_param(moved, fn)
        return result

    def _apply_to_flat_param(self, fn, recurse: bool) -> tuple[Any, torch.Tensor]:
        """``nn.Module._apply`` with the flat parameter registered (with
        ``use_orig_params=True`` in place of the originals, which view it), so that a move
        changes its data alone. Returns the result and the flat parameter's moved data:
        ``_apply`` registers a new parameter for a move across tensor types (to meta, say),
        so ours is registered again afterwards."""
        module, handle = self.module, self._handle
        params = registered_parameters(module)
        if self._use_orig_params:
            handle.hide_originals()
            params[FLAT_PARAM] = module.__dict__.pop(FLAT_PARAM)
        try:
            result = super()._apply(fn, recurse)
            moved = params[FLAT_PARAM].data
        finally:
            params.pop(FLAT_PARAM)
            if self._use_orig_params:
                module.__dict__[FLAT_PARAM] = handle.flat_param
                handle.show_sharded()
            else:
                params[FLAT_PARAM] = handle.flat_param
        return result, moved

    def check_is_root(self) -> bool:
        self._lazy_init()
        return bool(self._is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every instance in ``module``'s tree (only the outermost ones with ``root_only``)."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return found
        inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
        return [m for m in found if id(m) not in inner]

    # -- state dicts (see [Note: wrapper state dicts] in state_dict.py) ----------------

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state-dict type of every instance under ``module``; returns the previous
        settings."""
        return state_dict.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings every instance under ``module`` shares."""
        return state_dict.get_state_dict_type(module)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """``set_state_dict_type`` inside a ``with`` block, restored on exit."""
        with state_dict.state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        ):
            yield

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """``optim``'s state keyed by original parameter names (see optim_state.py)."""
        return optim_state.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from an ``optim_state_dict`` result."""
        return optim_state_load.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    # -- torch's older optimizer-state calls (see legacy_optim_state.py) -----------------

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: Any = None,
    ) -> dict[str, Any]:
        """Deprecated: ``optim_state_dict`` under ``FULL_STATE_DICT``."""
        return legacy_optim_state.full_optim_state_dict(
            model, optim, optim_input, rank0_only, group
        )

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
    ) -> dict[str, Any]:
        """Deprecated: ``optim_state_dict`` under ``SHARDED_STATE_DICT``."""
        return legacy_optim_state.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Deprecated: ``optim_state_dict_to_load`` of a full optimizer state dict."""
        return legacy_optim_state.shard_full_optim_state_dict(
            full_optim_state_dict, model, optim_input, optim
        )

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Deprecated: ``optim_state_dict_to_load`` of a sharded optimizer state dict."""
        return legacy_optim_state.flatten_sharded_optim_state_dict(
            sharded_optim_state_dict, model, optim
        )

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """Deprecated: ``optim_state_dict_to_load`` of rank 0's full optimizer state dict."""
        return legacy_optim_state.scatter_full_optim_state_dict(
            full_optim_state_dict, model, optim_input, optim, group
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: Any,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Key an optimizer state dict by parameter names or by parameter ids."""
        return legacy_optim_state.rekey_optim_state_dict(
            optim_state_dict, optim_state_key_type, model, optim_input, optim
        )

    # -- lazy init ----------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """The first instance to run forward becomes the root of every instance below it."""
        if self._is_root is not None:
            return
        instances = FullyShardedDataParallel.fsdp_modules(self)
        _refuse_stand_in_groups(instances)
        _refuse_optimizer_in_backward(instances)
        self._is_root = True
        ctx = RootContext()
        for instance in instances[1:]:
            if instance._is_root is not None:
                raise RuntimeError(
                    f"a nested FullyShardedDataParallel({type(instance.module).__name__}) ran "
                    "forward before its root; run forward through the root module first"
                )
            instance._is_root = False
        ctx.instances = instances
        for instance in instances:
            instance._root_ctx = ctx
            if instance._group is not None:
                instance._group.bind(ctx.comm)
        if self._group is not None and self.sharding_strategy in _RESHARD_AFTER_FORWARD:
            self._group.configure(reshard_after_forward=False)  # backward needs it at once
        for instance in instances:
            instance._cast_buffers()

    def _cast_buffers(self) -> None:
        """Floating buffers of this instance's own modules to its ``buffer_dtype``: each
        instance's own setting, so batch norm wrapped with mixed precision off stays fp32
        (see [Note: mixed precision skips batch norm] in wrap.py)."""
        mp = self.mixed_precision
        if mp.buffer_dtype is None:
            return
        for sub in self._own_modules():
            for name, buffer in sub.named_buffers(recurse=False, remove_duplicate=False):
                if buffer.is_floating_point():
                    setattr(sub, name, buffer.to(mp.buffer_dtype))

    def _own_modules(self) -> list[nn.Module]:
        return setup._unwrapped_modules(
            self._fsdp_wrapped_module, self._ignored_modules, FullyShardedDataParallel
        )

    # -- forward ------------------------------------------------------------------------

    @run_frame_eagerly  # see [Note: the wrapper's forward under compile]
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # FSDP's steps run eagerly; the wrapped module between them may be compiled.
        recompute, args, kwargs = self._pre_forward(args, kwargs)
        if recompute:
            return self._fsdp_wrapped_module(*args, **kwargs)
        try:
            output = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            self.training_state = TrainingState.IDLE
        return self._post_forward(output)

    @run_eagerly
    def _pre_forward(self, args: Any, kwargs: Any) -> tuple[bool, Any, Any]:
        """Returns ``(recompute, args, kwargs)``: ``recompute`` in activation-checkpoint
        recompute (parameters unsharded, nothing more)."""
        if in_backward():
            self._unshard_now()
            return True, args, kwargs
        self._lazy_init()
        ctx = self._root_ctx
        if ctx.iter_forward_root is None:
            ctx.iter_forward_root = self
            args, kwargs = self._root_pre_forward(args, kwargs)
        self.training_state = TrainingState.FORWARD
        args, kwargs = self._cast_inputs(args, kwargs, root=False)
        if self._group is not None:
            self._group.pre_forward()  # fresh views, so autograd sees this forward
            if not ctx.forward_order_recorded:
                ctx.forward_order.append(self)
            if self.forward_prefetch:
                self._prefetch(self._next_in_forward())
        return False, args, kwargs

    @run_eagerly
    def _post_forward(self, output: Any) -> Any:
        ctx = self._root_ctx
        if self._group is not None:
            backward_follows = torch.is_grad_enabled()
            self._group.post_forward(backward_follows=backward_follows)
            reshards = self.sharding_strategy in _RESHARD_AFTER_FORWARD
            if self._use_orig_params and (reshards or not backward_follows):
                # Shard views, as torch shows: the root keeps its gathered buffer for
                # backward, and SHARD_GRAD_OP keeps the full views for backward only.
                self._handle.show_sharded()
            if backward_follows:
                ctx.post_forward_order.append(self)
        output = register_pre_backward(self._pre_backward, output, owner=repr(self._group))
        if ctx.iter_forward_root is self:
            ctx.iter_forward_root = None
            ctx.forward_order_recorded = True
        return output

    def _unshard_now(self) -> None:
        """Gather and show the full parameters now, outside the forward's order."""
        if self._group is not None:
            self._group.unshard_and_show(after_compute=True)

    def _root_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        ctx = self._root_ctx
        ctx.comm.all_gather_stream(self.compute_device).wait_for_compute()
        if self.compute_device.type != "cpu":
            move = lambda t: t.to(self.compute_device, non_blocking=True)  # noqa: E731
            args, kwargs = map_tensors(move, (args, kwargs))
        if not self._is_root:  # a nested instance run on its own casts as a non-root
            return args, kwargs
        return self._cast_inputs(args, kwargs, root=True)

    def _cast_inputs(self, args: Any, kwargs: Any, *, root: bool) -> tuple[Any, Any]:
        mp = self.mixed_precision
        if mp.param_dtype is None:
            return args, kwargs
        if not (mp.cast_root_forward_inputs if root else mp.cast_forward_inputs):
            return args, kwargs
        return cast_floating((args, kwargs), mp.param_dtype)

    def _next_in_forward(self) -> FullyShardedDataParallel | None:
        order = self._root_ctx.forward_order
        if not self._root_ctx.forward_order_recorded or self not in order:
            return None
        index = order.index(self)
        return order[index + 1] if index + 1 < len(order) else None

    def _previous_in_forward(self) -> FullyShardedDataParallel | None:
        order = self._root_ctx.post_forward_order
        for index in range(len(order) - 1, -1, -1):
            if order[index] is self:
                return order[index - 1] if index > 0 else None
        return None

    @staticmethod
    def _prefetch(target: FullyShardedDataParallel | None) -> None:
        if target is None or target._group is None:
            return
        if target._group.training_state in (
            TrainingState.PRE_BACKWARD,
            TrainingState.POST_BACKWARD,
        ):
            return  # its backward already ran in this pass: gathering again would be waste
        target._group.unshard()

    # -- backward -----------------------------------------------------------------------

    @run_eagerly
    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self._root_ctx
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            root = ctx.instances[0] if ctx.instances else self
            queue_final_callback(root._final_callback)
        group = self._group
        if group is None or group.training_state is TrainingState.PRE_BACKWARD:
            return
        group.pre_backward()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch(self._previous_in_forward())

    def _post_backward(self) -> None:
        group = self._group
        assert group is not None
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            # Before this unit's reduction, as torch orders them: the next unit's gather is
            # not queued behind the reduce-scatter.
            self._prefetch(self._previous_in_forward())
        group.post_backward()

    @run_eagerly
    def _final_callback(self) -> None:
        ctx = self._root_ctx
        try:
            end_backward([i._group for i in ctx.instances if i._group is not None], ctx.comm)
            for instance in ctx.instances:
                instance.training_state = TrainingState.IDLE
                if instance._use_orig_params and instance._handle is not None:
                    # Groups kept unsharded for the next backward (no_sync) show shards too.
                    instance._handle.show_sharded()
            ctx.post_forward_order.clear()
        finally:
            ctx.final_callback_queued = False
            ctx.iter_forward_root = None

    # -- communication hooks ------------------------------------------------------------

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """Reduce the gradients of every instance under this root with ``hook``.

        Once per instance per synchronized backward the hook replaces the default reduction
        (its collectives and its averaging): ``hook(state, grad)`` under ``NO_SHARD``, with
        the unsharded flat gradient to reduce in place; ``hook(state, grad, output)`` under
        the sharded strategies, with the padded unsharded flat gradient and this rank's
        shard to fill. Built-in hooks live in ``reffsdp.algorithms.default_hooks``. Register
        once, on the root, best before the first forward (a later registration applies from
        the next backward on); hybrid strategies take no hook.
        """
        # torch's tests match the first two messages whole: our detail goes in a note.
        if not self.check_is_root():
            raise _with_note(
                AssertionError("register_comm_hook can only be called on a root instance."),
                f"FullyShardedDataParallel({type(self.module).__name__}) is nested; call it on "
                "the outermost instance, and the hook applies to every instance under it",
            )
        instances = self._root_ctx.instances
        for instance in instances:
            if instance.sharding_strategy in setup.HYBRID:
                raise AssertionError(
                    "Communication hook is not supported for hybrid strategies: "
                    f"FullyShardedDataParallel({type(instance.module).__name__}) runs "
                    f"{instance.sharding_strategy}"
                )
            group = instance._group
            if group is not None and group.settings.custom_reduction is not None:
                raise _with_note(
                    AssertionError("A communication hook is already registered"),
                    "register_comm_hook() may be called once per root",
                )
        if not callable(hook):
            raise ValueError(f"the communication hook must be callable, got {type(hook).__name__}")
        reduction = CustomReduction(
            functools.partial(hook, state),
            # Low-precision hooks pick the communication dtype: hand them gradients uncast.
            cast_to_reduce_dtype=hook not in LOW_PRECISION_HOOKS,
        )
        for instance in instances:
            if instance._group is not None:
                instance._group.configure(custom_reduction=reduction)

    # -- gradient accumulation ----------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, until the context exits.

        Meanwhile ``.grad`` shows this rank's own gradient, unsharded (see [Note: gradients
        kept while sync is off] in flat_param): under the sharded strategies step the
        optimizer only after a backward outside the context, which reduces it."""
        self._lazy_init()
        if not self._is_root:
            raise RuntimeError("no_sync() must be called on the root FullyShardedDataParallel")
        instances = self._root_ctx.instances
        previous = [(i, i._group.settings) for i in instances if i._group is not None]
        for instance, settings in previous:
            keep = instance.sharding_strategy not in _RESHARD_AFTER_FORWARD
            instance._sync_gradients = False
            instance._group.configure(
                reduce_grads=False,
                reshard_after_backward=settings.reshard_after_backward and not keep,
            )
        try:
            yield
        finally:
            for instance, settings in previous:
                instance._sync_gradients = True
                instance._group.configure(
                    reduce_grads=settings.reduce_grads,
                    reshard_after_backward=settings.reshard_after_backward,
                )

    # -- full parameters and utilities (see [Note: summoning full parameters] in full_params)

    _summoning = False  # inside summon_full_params (or apply) for this instance

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Show full, unsharded original parameters of every instance in ``module``'s tree
        (only ``module`` itself with ``recurse=False``) for the duration of the context.

        ``writeback`` copies edits back to the shards on exit; ``rank0_only`` shows them on
        rank 0 only; ``offload_to_cpu`` shows CPU copies; ``with_grads`` shows full
        gradients too (``use_orig_params=True`` only). Call it outside forward and backward.
        """
        with full_params.summon_full_params(
            module,
            recurse=recurse,
            writeback=writeback,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
        ):
            yield

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s; inside ``summon_full_params`` names drop the wrapper prefix."""
        yield from full_params.clean_names(self, super().named_parameters(*args, **kwargs))

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``nn.Module``'s; inside ``summon_full_params`` names drop the wrapper prefix."""
        yield from full_params.clean_names(self, super().named_buffers(*args, **kwargs))

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this instance's full parameters shown and written back."""
        return full_params.apply(self, fn, super().apply)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model in place (root only; every rank must call
        it); return the total norm, as for the unsharded model."""
        return full_params.clip_grad_norm(self, max_norm, norm_type)


def _with_note(error: Exception, note: str) -> Exception:
    """``error`` with ``note`` shown below its message in tracebacks (Python 3.11 on), for
    messages that must read exactly as torch's."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    return error


def _refuse_stand_in_groups(instances: list[FullyShardedDataParallel]) -> None:
    """Forward, backward, summoning and state dicts communicate: a stand-in cannot."""
    for instance in instances:
        if isinstance(instance._mesh_info.mesh, setup.StandInMesh):
            raise TypeError(
                f"FullyShardedDataParallel({type(instance.module).__name__}) was built over "
                f"a stand-in process group ({type(instance.process_group).__name__}, with "
                "rank() and size() only), which decides sharding and wrapping but cannot "
                "communicate; build it over a torch.distributed ProcessGroup to run it"
            )


def _refuse_optimizer_in_backward(instances: list[FullyShardedDataParallel]) -> None:
    """Parameters handed to ``torch.distributed.optim._apply_optimizer_in_backward`` are
    marked (``has_optimizer_in_backward``). On flat parameters torch's wrapper refuses them;
    on original parameters it steps them in its post-backward, which ours does not: their
    gradients are set after the reduction, so those optimizers would never step."""
    for instance in instances:
        handle = instance._handle
        if handle is None:
            continue
        name = f"FullyShardedDataParallel({type(instance.module).__name__})"
        if has_optimizer_in_backward(handle.flat_param):
            raise RuntimeError(
                "FSDP optimizer in backward only supported with use_orig_params=True: the "
                f"flat parameter of {name} was given to an optimizer that steps in backward; "
                "wrap with use_orig_params=True, or step an ordinary optimizer after backward"
            )
        if any(has_optimizer_in_backward(p) for p in handle.orig_params):
            raise NotImplementedError(
                f"parameters of {name} were given to an optimizer that steps in backward, "
                "which reffsdp's wrapper does not run (torch's does with "
                "use_orig_params=True); step an ordinary optimizer after backward"
            )


FullyShardedDataParallel.__module__ = "reffsdp"
