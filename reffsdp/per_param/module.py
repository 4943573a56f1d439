"""``FSDPModule``: the methods a module gains from ``fully_shard``.

``fully_shard`` swaps a module's class for a subclass of ``(FSDPModule, OriginalClass)``;
the methods below then act on the module's ``fully_shard`` state.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..core import comms
from ..core.param_group import ParamGroup
from . import finalization, symm_mem
from .state import AsyncFinalization, FSDPState, state_of


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def wait(self) -> None:
        return None


class _GroupUnshardHandle(UnshardHandle):
    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)``; ``wait()`` finishes the
    gradient reductions and ends the backward iteration (``RuntimeError`` if
    ``reset_iter_state()`` dropped them since)."""

    def wait(self) -> None:
        return None


class _StateGradientReductionHandle(GradientReductionHandle):
    def __init__(self, state: FSDPState, pending: AsyncFinalization) -> None:
        self._state: FSDPState | None = state
        self._pending = pending

    def wait(self) -> None:
        if self._state is not None:  # a second wait() has nothing left to do
            finalization.wait(self._state, self._pending)
            self._state = None


class FSDPModule:
    """Mixin added to every module passed to ``fully_shard``."""

    def __new__(cls, *args: Any, **kwargs: Any):
        # Code such as ``nn.Sequential.__getitem__`` builds ``self.__class__(...)``; give
        # it a plain instance of the original class rather than an unsharded "FSDP" one.
        orig_cls = cls.__mro__[2]
        instance = orig_cls.__new__(orig_cls, *args, **kwargs)
        instance.__init__(*args, **kwargs)
        return instance

    def _get_fsdp_state(self) -> FSDPState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError(f"no fully_shard state on {type(self).__name__}")
        return state

    def _groups(self) -> list[ParamGroup]:
        """This module's groups: one per mesh (see [Note: per-parameter meshes] in
        ``placement``), none without parameters of its own."""
        return list(self._get_fsdp_state().groups)

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]

    def _configure(self, recurse: bool, **changes: Any) -> None:
        """Change group settings (``GroupSettings`` fields) here, or in every submodule."""
        for module in self._fsdp_modules(recurse):
            for group in module._groups():
                group.configure(**changes)

    # -- unshard / reshard --------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (in ``param_dtype``)."""
        _check_bool("unshard", async_op=async_op)
        groups = self._groups()
        for group in groups:
            # Before the first forward the group gathers through its state's own context
            # (see [Note: root and lazy init] in reffsdp/core/driver.py).
            group.unshard(async_op=async_op, after_compute=True)
        handle = _GroupUnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Register the sharded parameters and free the unsharded storage (this module
        only), unless ``set_keep_unsharded_storage(True)`` asked to keep it."""
        for group in self._groups():
            group.reshard()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters' storage when resharding, so their data pointers
        stay the same from one unshard to the next (e.g. for CUDA graphs), at the cost of
        holding that memory (see [Note: tensor lifecycle] in ``sharded_param``)."""
        _check_bool("set_keep_unsharded_storage", keep=keep, recurse=recurse)
        for module in self._fsdp_modules(recurse):
            for group in module._groups():
                for param in group.members:
                    param.keep_unsharded_storage = keep

    def reset_iter_state(self) -> None:
        """On the root, after an exception in forward/backward: reshard and drop partial grads."""
        self._get_fsdp_state().reset_iter_state()

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any):  # type: ignore[override]
        # ``.to()``, ``.float()``, ``to_empty()``: convert the sharded parameters, then re-pad
        # them so they keep sharing storage with the all-gather input.
        self.reshard()
        result = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        for group in self._groups():
            for param in group.members:
                param.reset_sharded_param()
        return result

    # -- gradient synchronization -------------------------------------------------------

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        _check_bool("set_is_last_backward", is_last_backward=is_last_backward)
        self._get_fsdp_state().ctx.is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root: the caller ends each backward iteration with :meth:`finalize_backward`
        instead of the end of autograd's backward (which ``set_is_last_backward`` steers).

        Set it before backward starts; see [Note: manual backward finalization] in
        ``reffsdp/per_param/finalization.py``.
        """
        _check_bool("set_manual_backward_finalization", enabled=enabled)
        finalization.set_mode(self._get_fsdp_state(), enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """On the root, after the step's backward passes: reduce what is pending, reshard,
        wait for the reductions and end the iteration (manual finalization only).

        With ``async_op=True`` the wait is left to the returned handle; call its ``wait()``
        before reading gradients or running forward again. A no-op before the first forward.
        """
        _check_bool("finalize_backward", async_op=async_op)
        state = self._get_fsdp_state()
        pending = finalization.finalize(state, async_op=async_op)
        if not async_op:
            return None
        if pending is None:
            return GradientReductionHandle()
        return _StateGradientReductionHandle(state, pending)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """Turn reduce-scatter (and HSDP all-reduce) on or off, e.g. for microbatches."""
        _check_bool(
            "set_requires_gradient_sync",
            requires_gradient_sync=requires_gradient_sync,
            recurse=recurse,
        )
        self._configure(
            recurse, reduce_grads=requires_gradient_sync, all_reduce_grads=requires_gradient_sync
        )

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        """HSDP: reduce-scatter but skip the all-reduce across replicas while off."""
        _check_bool(
            "set_requires_all_reduce", requires_all_reduce=requires_all_reduce, recurse=recurse
        )
        self._configure(recurse, all_reduce_grads=requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True):
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward expects reshard_after_forward to be a bool, got "
                f"{reshard_after_forward!r}"
            )
        _check_bool("set_reshard_after_forward", recurse=recurse)
        self._configure(recurse, reshard_after_forward=reshard_after_forward)
        for module in self._fsdp_modules(recurse):
            module._get_fsdp_state().auto_reshard_root = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        _check_bool(
            "set_reshard_after_backward",
            reshard_after_backward=reshard_after_backward,
            recurse=recurse,
        )
        self._configure(recurse, reshard_after_backward=reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        _check_bool("set_unshard_in_backward", unshard_in_backward=unshard_in_backward)
        self._configure(False, unshard_in_backward=unshard_in_backward)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        _check_bool(
            "set_reduce_scatter_unused_params",
            reduce_scatter_unused_params=reduce_scatter_unused_params,
            recurse=recurse,
        )
        self._configure(recurse, reduce_scatter_unused_params=reduce_scatter_unused_params)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(
                f"set_gradient_divide_factor expects factor to be a float, got {factor!r}"
            )
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(
                f"set_gradient_divide_factor expects a positive, finite factor, got {factor}; "
                "gradients are divided by it"
            )
        self._configure(False, gradient_divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use only SUM collectives and divide separately (for backends without AVG)."""
        _check_bool("set_force_sum_reduction_for_comms", enable=enable)
        self._configure(False, force_sum_reduction=enable)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Run ``hook`` on each reduced gradient shard (after the all-reduce for HSDP).

        ``stream`` is where the hook runs; with native HSDP (a 2D mesh) it runs where the
        all-reduce did, so a stream cannot be given (the message is torch's, word for word).
        """
        groups = self._refuse_several_groups("set_all_reduce_hook")
        if stream is not None and any(g.mesh_info.is_hsdp for g in groups):
            raise ValueError("stream cannot be set when using native HSDP")
        self._configure(False, all_reduce_hook=hook, all_reduce_hook_stream=stream)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's all-gathers wait for ``event`` instead of the whole stream."""
        self._get_fsdp_state().ctx.post_optim_event = event

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Bound how many reduce-scatters may be in flight (each keeps its input alive).

        Without a bound set, one may be in flight on an accelerator and none on CPU (see
        [Note: bounded in-flight reductions] in ``reffsdp/core/runtime.py``).
        """
        if not isinstance(max_input_buffers, int) or isinstance(max_input_buffers, bool):
            raise TypeError(f"max_input_buffers must be an int, got {max_input_buffers!r}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be at least 1, got {max_input_buffers}")
        self._configure(recurse, max_pending_reduces=max_input_buffers)

    # -- custom communication -----------------------------------------------------------

    def set_custom_all_gather(self, comm: comms.AllGather) -> None:
        """All-gather this module's parameters with ``comm`` (allocation and collective)."""
        self._single_group("set_custom_all_gather").configure(all_gather_comm=comm)

    def set_custom_reduce_scatter(self, comm: comms.ReduceScatter) -> None:
        """Reduce-scatter this module's gradients with ``comm``."""
        self._single_group("set_custom_reduce_scatter").configure(reduce_scatter_comm=comm)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True):
        """Reduce-scatter on a second process group over the same ranks as the all-gather,
        so the two kinds of collective do not queue behind each other."""
        _check_bool("set_separate_reduce_scatter_group", enable=enable, recurse=recurse)
        for module in self._fsdp_modules(recurse):
            for group in module._groups():
                shard_group = group.mesh_info.shard_group
                group.configure(
                    reduce_scatter_group=(
                        comms.same_ranks_group(shard_group) if enable and shard_group else None
                    )
                )

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for compatibility: buffers always come from the caching allocator. It is
        remembered, as it rules out ``set_symm_mem_for_comm`` while on (as in torch)."""
        _check_bool("set_allocate_memory_from_process_group_for_comm", enable=enable)
        for group in self._groups():
            settings = group.settings
            for kind, comm in (
                ("all gather", settings.all_gather_comm),
                ("reduce scatter", settings.reduce_scatter_comm),
            ):
                if comm is not None:
                    raise AssertionError(
                        "cannot call set_allocate_memory_from_process_group() when "
                        f"{kind} comm is custom: {type(comm).__name__}; "
                        "set_allocate_memory_from_process_group_for_comm cannot be combined "
                        "with a custom all-gather or reduce-scatter, or symmetric memory"
                    )
        self._get_fsdp_state().allocating_from_process_group = enable

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """All-gather this module's parameters into buffers of symmetric memory from
        ``backend`` (torch's symmetric memory), for NCCL's copy-engine or symmetric-kernel
        all-gathers; see [Note: symmetric memory] in ``reffsdp/per_param/symm_mem.py`` for
        what is checked, and what happens on a CPU mesh or a build without the backend."""
        symm_mem.use_for_all_gathers(
            self._groups(),
            backend,
            allocating_from_process_group=self._get_fsdp_state().allocating_from_process_group,
        )

    def _single_group(self, method: str) -> ParamGroup:
        """The module's one group, for a setting that names one communication. Several are
        refused as by torch; none too (torch ignores the setting then)."""
        groups = self._refuse_several_groups(method)
        if not groups:
            raise ValueError(
                f"{method} needs a module with exactly one parameter group, but "
                f"{type(self).__name__} has no parameters of its own"
            )
        return groups[0]

    def _refuse_several_groups(self, method: str) -> list[ParamGroup]:
        """This module's groups, unless there are several (rule 5 of [Note: per-parameter
        meshes] in ``placement``)."""
        groups = self._groups()
        if len(groups) > 1:
            raise ValueError(
                f"{method} is not supported with multiple param groups (from per-param mesh "
                f"via shard_placement_fn): {type(self).__name__} has {len(groups)}, one per "
                "mesh, and one communication would be ambiguous across their meshes"
            )
        return groups

    # -- prefetching --------------------------------------------------------------------

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._get_fsdp_state().forward_prefetch = _states_of(modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._get_fsdp_state().backward_prefetch = _states_of(modules, "backward")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Issue forward/backward all-gathers on the current stream instead of the side
        stream (they are asynchronous either way and waited where the data is needed)."""
        _check_bool("_set_unshard_async_op", async_op=async_op)
        self._configure(True, unshard_async_op=async_op)


def _check_bool(method: str, **flags: Any) -> None:
    """Refuse non-bool flags: ``set_requires_gradient_sync("no")`` would otherwise read as True."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{method} expects {name} to be a bool, got {value!r}")


def _states_of(modules: list[Any], direction: str) -> list[FSDPState]:
    states = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"set_modules_to_{direction}_prefetch expects FSDPModules, got "
                f"{type(module).__name__}"
            )
        states.append(module._get_fsdp_state())
    return states


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's pre/post-forward around ``module.<method_name>`` (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    state = module._get_fsdp_state()
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(module, args, kwargs)
        output = method(*args, **kwargs)
        return state._post_forward(module, args, output)

    module.__dict__[method_name] = wrapped


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots (e.g. pipeline stages) share the first one's comm context."""
    if not modules:
        return
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx expects FSDPModules, got {type(module).__name__}")
    shared = modules[0]._get_fsdp_state().comm_ctx
    for module in modules[1:]:
        state = module._get_fsdp_state()
        if state.comm_ctx is not shared and state.comm_ctx.async_finalization is not None:
            raise RuntimeError(
                f"share_comm_ctx: {state} has an asynchronous finalize_backward not yet "
                "waited on; call wait() on its handle before sharing its context"
            )
        state.share_comm_ctx(shared)


for _obj in (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
):
    _obj.__module__ = "reffsdp"
