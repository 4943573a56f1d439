"""``FullyShardedDataParallel``: the wrapper API, a thin front end on the shared core.

The ``nn.Module`` here is a facade: each instance's state, its hooks and what it owns live on
a :class:`~reffsdp.wrapper.state.WrapperState` (see [Note: the wrapper on the core] and
[Note: an instance's state and its module] in ``state.py``), and the methods below delegate
to it and to the helper modules: ``full_params`` (summoning, ``apply``, clipping),
``state_dict``, ``optim_state``, ``optim_state_load`` and ``legacy_optim_state``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
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
from ..core.collectives import CustomReduction
from ..core.compile_support import install_eager_methods, mark_fsdp_managed
from ..core.mesh import MeshInfo
from ..core.states import TrainingState
from ..core.torch_internals import registered_children, registered_parameters
from ..wrap import WrapDecision, auto_wrap_children
from . import full_params, legacy_optim_state, optim_state, optim_state_load, setup, state_dict
from .compile_support import call_through_wrappers, run_frame_eagerly
from .config import HYBRID, WrapperConfig
from .flat_param import FlatParameter, FlatParamHandle
from .state import FLAT_PARAM, RESHARD_AFTER_FORWARD, STATE_KEY, WRAPPED_MODULE, WrapperState


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
        setup.check_module(module, FullyShardedDataParallel)
        config = WrapperConfig(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            ignored_modules=ignored_modules,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            ignored_states=ignored_states,
            device_mesh=device_mesh,
        )
        self._build(module, config)

    @classmethod
    def _from_config(cls, module: nn.Module, config: WrapperConfig) -> FullyShardedDataParallel:
        """An instance built from a checked config: how auto-wrapping builds children (see
        [Note: the wrapper's configuration] in config.py)."""
        instance = cls.__new__(cls)
        nn.Module.__init__(instance)
        instance._build(module, config)
        return instance

    def _build(self, module: nn.Module, config: WrapperConfig) -> None:
        """Wrap ``module`` as ``config`` says: its mesh and device, the children a policy
        picks, then this instance's state (kept under it: see [Note: an instance's state and
        its module] in state.py) and its own parameters, flattened."""
        asked = config.sharding_strategy
        device = setup.compute_device(
            module, config.device_id, config.process_group, config.device_mesh
        )
        mesh_info = setup.mesh_info_for_strategy(asked, config, device)
        runs = setup.strategy_for_group(asked, mesh_info)
        if runs is not asked:
            mesh_info = setup.mesh_info_for_strategy(runs, config, device)
        ignored = setup.ignored_sets(module, config, FullyShardedDataParallel)
        mark_fsdp_managed(
            (m for m in module.modules() if m not in ignored.modules),
            params_are_own=config.use_orig_params,
        )
        install_eager_methods(FullyShardedDataParallel)
        if config.auto_wrap_policy is not None:
            _wrap_children(module, config, mesh_info, ignored)
        state = WrapperState(self, config, runs, mesh_info, device, ignored)
        self.__dict__[STATE_KEY] = state
        self.add_module(WRAPPED_MODULE, module)
        state_dict.init_state_dict(state)
        _take_parameters(state)

    # -- what torch's wrapper shows -------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module (under an activation-checkpoint wrapper, the module inside)."""
        return self._fsdp_wrapper_state.inner

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The strategy this instance runs (``NO_SHARD`` for a sharded one over one rank)."""
        return self._fsdp_wrapper_state.strategy

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._fsdp_wrapper_state.config.cpu_offload

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._fsdp_wrapper_state.config.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._fsdp_wrapper_state.config.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return self._fsdp_wrapper_state.config.limit_all_gathers

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._fsdp_wrapper_state.config.precision

    @property
    def compute_device(self) -> torch.device:
        return self._fsdp_wrapper_state.device

    @property
    def process_group(self) -> Any:
        return self._fsdp_wrapper_state.process_group

    @property
    def rank(self) -> int:
        return self._fsdp_wrapper_state.rank

    @property
    def world_size(self) -> int:
        return self._fsdp_wrapper_state.world_size

    @property
    def training_state(self) -> TrainingState:
        return self._fsdp_wrapper_state.training_state

    @property
    def _handle(self) -> FlatParamHandle | None:
        """This instance's flat-parameter handle, where torch's wrapper keeps its own."""
        return self._fsdp_wrapper_state.handle

    @property
    def _is_root(self) -> bool | None:
        """Whether this instance is a root (``None`` before a root's lazy init), as torch's."""
        return self._fsdp_wrapper_state.is_root

    @property
    def _flat_param(self) -> FlatParameter | None:
        handle = self._fsdp_wrapper_state.handle
        return handle.flat_param if handle is not None else None

    @property
    def params(self) -> list[FlatParameter]:
        """This instance's flat parameter in a list, as torch's wrapper lists it: one
        element, or none for an instance that manages no parameters of its own (a root whose
        modules were all wrapped by children, say).

        The flat parameter is the one object the instance keeps from construction on; a move
        (``to()``, ``half()``) changes its data, not the object.
        """
        flat_param = self._flat_param
        return [flat_param] if flat_param is not None else []

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
        state = self._fsdp_wrapper_state
        handle, group = state.handle, state.group
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
        state = self._fsdp_wrapper_state
        module, handle = state.inner, state.handle
        use_orig_params = state.config.use_orig_params
        params = registered_parameters(module)
        if use_orig_params:
            handle.hide_originals()
            params[FLAT_PARAM] = module.__dict__.pop(FLAT_PARAM)
        try:
            result = super()._apply(fn, recurse)
            moved = params[FLAT_PARAM].data
        finally:
            params.pop(FLAT_PARAM)
            if use_orig_params:
                module.__dict__[FLAT_PARAM] = handle.flat_param
                handle.show_sharded()
            else:
                params[FLAT_PARAM] = handle.flat_param
        return result, moved

    def check_is_root(self) -> bool:
        state = self._fsdp_wrapper_state
        state.lazy_init()
        return bool(state.is_root)

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

    # -- forward (see [Note: hook order] in reffsdp/core/driver.py) -----------------------

    @run_frame_eagerly  # see [Note: the wrapper's forward under compile]
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # FSDP's steps run eagerly; the wrapped module between them may be compiled.
        state = self._fsdp_wrapper_state
        full_params.refuse_forward_while_summoning(state)
        args, kwargs = state._pre_forward(self, args, kwargs)
        try:
            output = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            state._leave_forward()  # idle again after an error too
        return state._post_forward(self, args, output)

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
                f"{self._fsdp_wrapper_state} is nested; call it on the outermost instance, "
                "and the hook applies to every instance under it",
            )
        instances = self._fsdp_wrapper_state.ctx.states
        for instance in instances:
            if instance.strategy in HYBRID:
                raise AssertionError(
                    "Communication hook is not supported for hybrid strategies: "
                    f"{instance} runs {instance.strategy}"
                )
            group = instance.group
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
            if instance.group is not None:
                instance.group.configure(custom_reduction=reduction)

    # -- gradient accumulation ----------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, until the context exits.

        Meanwhile ``.grad`` shows this rank's own gradient, unsharded (see [Note: gradients
        kept while sync is off] in flat_param): under the sharded strategies step the
        optimizer only after a backward outside the context, which reduces it."""
        root = self._fsdp_wrapper_state
        root.lazy_init()
        if not root.is_root:
            raise RuntimeError("no_sync() must be called on the root FullyShardedDataParallel")
        previous = [(i, i.group.settings) for i in root.ctx.states if i.group is not None]
        for instance, settings in previous:
            keep = instance.strategy not in RESHARD_AFTER_FORWARD
            instance.sync_gradients = False
            instance.group.configure(
                reduce_grads=False,
                reshard_after_backward=settings.reshard_after_backward and not keep,
            )
        try:
            yield
        finally:
            for instance, settings in previous:
                instance.sync_gradients = True
                instance.group.configure(
                    reduce_grads=settings.reduce_grads,
                    reshard_after_backward=settings.reshard_after_backward,
                )

    # -- full parameters and utilities (see [Note: summoning full parameters] in full_params)

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
        named = super().named_parameters(*args, **kwargs)
        yield from full_params.clean_names(self._fsdp_wrapper_state, named)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``nn.Module``'s; inside ``summon_full_params`` names drop the wrapper prefix."""
        named = super().named_buffers(*args, **kwargs)
        yield from full_params.clean_names(self._fsdp_wrapper_state, named)

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this instance's full parameters shown and written back."""
        return full_params.apply(self._fsdp_wrapper_state, fn, super().apply)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model in place (root only; every rank must call
        it); return the total norm, as for the unsharded model."""
        return full_params.clip_grad_norm(self._fsdp_wrapper_state, max_norm, norm_type)


def _wrap_children(
    module: nn.Module, config: WrapperConfig, mesh_info: MeshInfo, ignored: setup.Ignored
) -> None:
    """Wrap what the root's policy picks below ``module``. Every child is built from one
    config made from the root's: the hybrid mesh built once, here, in place of process
    groups, the root's ignored parameters ignored inside the children holding them, no
    policy. Each then changes what its :class:`~reffsdp.wrap.WrapDecision` says."""
    hybrid = config.sharding_strategy in HYBRID
    children = dataclasses.replace(
        config,
        process_group=None if hybrid else config.process_group,
        device_mesh=mesh_info.mesh if hybrid else config.device_mesh,
        auto_wrap_policy=None,
        ignored_modules=None,
        ignored_states=tuple(ignored.params) or None,
    )

    def wrap_child(child: nn.Module, decision: WrapDecision) -> FullyShardedDataParallel:
        child_config = children.with_overrides(decision.overrides, type(child).__name__)
        if decision.full_precision:  # see [Note: mixed precision skips batch norm] in wrap.py
            child_config = dataclasses.replace(child_config, mixed_precision=None)
        return FullyShardedDataParallel._from_config(child, child_config)

    auto_wrap_children(
        module,
        config.auto_wrap_policy,
        FullyShardedDataParallel,
        wrap_child,
        ignored.modules,
        ignored.params,
        mixed_precision=config.mixed_precision,
        use_orig_params=config.use_orig_params,
    )
    call_through_wrappers(module, FullyShardedDataParallel)


def _take_parameters(state: WrapperState) -> None:
    """Give this instance's own modules real storage on its device (rank 0's values with
    ``sync_module_states``) and flatten their parameters into its group."""
    config, module, ignored = state.config, state.wrapped, state.ignored
    setup.materialize(
        module, config.param_init_fn, state.device, ignored.modules, FullyShardedDataParallel
    )
    own_modules = state.own_modules()
    offload = config.cpu_offload.offload_params
    setup.move_to_device(own_modules, state.device, offload, FullyShardedDataParallel)
    entries = setup.managed_params(
        module, ignored.modules, ignored.params, FullyShardedDataParallel, FLAT_PARAM
    )
    if config.sync_module_states:
        buffers = [b for m in own_modules for b in m.buffers(recurse=False)]
        setup.sync_module_states([p for p, _ in entries], buffers, state.mesh_info)
    if entries:
        state.build_group(entries)


def _with_note(error: Exception, note: str) -> Exception:
    """``error`` with ``note`` shown below its message in tracebacks (Python 3.11 on), for
    messages that must read exactly as torch's."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    return error


FullyShardedDataParallel.__module__ = "reffsdp"
