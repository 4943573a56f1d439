"""Full parameters on demand for the wrapper API: the logic behind
``FullyShardedDataParallel.summon_full_params``, ``apply`` and ``clip_grad_norm_``.

[Note: summoning full parameters]
``summon_full_params`` unshards every instance it covers through the instance's own core
group (``ParamGroup.unshard`` + ``wait_for_unshard``), outside forward and backward:

1. The gather runs in the parameters' original dtype: with mixed precision the handle's
   ``param_dtype`` and its low-precision buffers are set aside for the gather, so the group
   allocates fresh full-precision ones; the set-aside buffers come back on exit, since a
   pending backward's saved views alias them. A group still unsharded since forward
   without mixed precision (SHARD_GRAD_OP, the root) is shown as is.
2. The original parameters appear under their own names as full-size ``nn.Parameter`` s
   viewing the gathered buffer (or a CPU copy of it, ``offload_to_cpu``). With
   ``use_orig_params=True`` these are the very parameter objects the optimizer holds, their
   ``.data`` swapped; otherwise fresh parameters, and the flat parameter leaves the module's
   parameters for the duration, as torch's does.
3. On exit, ``writeback`` copies this rank's chunk of the (possibly edited) full buffer into
   the local shard, so the optimizer's shard and every later forward see the edit. NO_SHARD
   always writes back: its full parameters are its shard, edits persist in torch too.
4. The group reshards (only if the summon gathered), or shows the forward's views again.

``with_grads`` (``use_orig_params=True`` only, like torch's) gathers each rank's gradient
shard with one all-reduce (does any rank hold a gradient?) and one all-gather, shows the full
gradients as ``.grad`` and, with ``writeback``, copies this rank's chunk back.

[Note: clipping sharded gradients]
The total norm is the p-norm of every gradient element of the unsharded model. Sharded
gradients (FULL_SHARD, SHARD_GRAD_OP, hybrid) hold disjoint pieces, so their local
``sum |g|^p`` (or max, for inf) is all-reduced over the root's group; gradients every rank
holds whole (NO_SHARD instances, ignored or unmanaged parameters) are added once, locally.
Per-gradient norms are taken in fp32 and the result is returned in the gradients' promoted
dtype. Two ranks, p=2, shards [3] and [4], a replicated gradient [12]:
``sqrt(9 + 16 + 144) = 13``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import ShardingStrategy
from ..core import comms
from ..core.states import TrainingState
from ..core.torch_internals import registered_parameters
from .flat_param import FlatParamHandle, _assign_grad, _set_tensor
from .state import FLAT_PARAM, WRAPPED_MODULE, WrapperState, state_of, states_under

WRAPPER_PREFIX = f"{WRAPPED_MODULE}."


def _uses_sharded_strategy(instance: WrapperState) -> bool:
    return instance.strategy is not ShardingStrategy.NO_SHARD


def _rank_in_group(instance: WrapperState) -> int:
    group = instance.process_group
    return dist.get_rank(group) if group is not None else 0


# -- summon_full_params --------------------------------------------------------------------


def clean_names(
    instance: WrapperState, named: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """Names without the wrapper prefix while ``instance`` is summoned (torch's rule)."""
    strip = instance.summoning
    for name, value in named:
        yield (name.replace(WRAPPER_PREFIX, "") if strip else name), value


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    *,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    if recurse:
        instances = states_under(module)
    else:
        instances = [state] if (state := state_of(module)) is not None else []
    options = dict(
        writeback=writeback,
        rank0_only=rank0_only,
        offload_to_cpu=offload_to_cpu,
        with_grads=with_grads,
    )
    with contextlib.ExitStack() as stack:
        for instance in instances:  # outermost first; exits run innermost first
            stack.enter_context(summon_one(instance, **options))
        yield


def _check_options(
    instance: WrapperState,
    *,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    """torch's rules for the option combinations it does not support."""
    use_orig_params = instance.config.use_orig_params
    if with_grads and (offload_to_cpu or not use_orig_params):
        raise NotImplementedError(
            f"summon_full_params(with_grads=True) needs use_orig_params=True and "
            f"offload_to_cpu=False; got use_orig_params={use_orig_params}, "
            f"offload_to_cpu={offload_to_cpu} on {instance}"
        )
    if offload_to_cpu and instance.handle is not None and not _uses_sharded_strategy(instance):
        raise NotImplementedError(
            f"summon_full_params(offload_to_cpu=True) is not supported for NO_SHARD "
            f"({instance}); its full parameters are already local"
        )
    if writeback and rank0_only:
        raise NotImplementedError(
            "summon_full_params(writeback=True, rank0_only=True) is not supported: the other "
            "ranks have no full parameters to write back; pass writeback=False"
        )
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "summon_full_params(offload_to_cpu=True, rank0_only=False) copies the full "
            "parameters to CPU memory on every rank, which may run out of host memory when "
            "ranks share a host; consider rank0_only=True",
            stacklevel=4,
        )


def _busy_state(instance: WrapperState) -> str | None:
    """What keeps ``instance`` from unsharding by hand now, by name, or ``None``."""
    group = instance.group
    if instance.summoning:
        return "SUMMON_FULL_PARAMS"
    if instance.training_state is not TrainingState.IDLE:
        return instance.training_state.name
    if group is not None and group.training_state is not TrainingState.IDLE:
        return group.training_state.name
    if instance.ctx.final_callback_queued:
        return "BACKWARD"
    return None


def _check_idle(instance: WrapperState) -> None:
    state = _busy_state(instance)
    if state == "SUMMON_FULL_PARAMS":
        raise AssertionError(
            f"Cannot manually unshard parameters when already unsharding parameters: "
            f"{instance} is already inside summon_full_params"
        )
    if state is not None:
        raise AssertionError(
            f"Cannot manually unshard parameters during forward/backward: {instance} "
            f"is in training state {state}; call summon_full_params outside forward and "
            "backward"
        )


def refuse_forward_while_summoning(instance: WrapperState) -> None:
    """Forward is refused while any instance of ``instance``'s tree is summoned: it would
    gather into (and free) the buffers the full parameters are shown from, and torch's
    wrapper fails there deep inside ("setStorage: sizes ...")."""
    summoned = next((s for s in (instance, *instance.ctx.states) if s.summoning), None)
    if summoned is not None:
        raise RuntimeError(
            f"{instance} cannot run forward inside summon_full_params (entered for "
            f"{summoned}): the full parameters it shows are for reading and editing between "
            "iterations; leave the context first, then run the model"
        )


@contextlib.contextmanager
def summon_one(instance: WrapperState, **options: bool) -> Iterator[None]:
    """Unshard one instance's own parameters for the duration (see the note above)."""
    _check_options(instance, **options)
    instance.lazy_init()
    _check_idle(instance)
    instance.summoning = True
    try:
        if instance.group is None:
            yield
            return
        writeback = options["writeback"] or not _uses_sharded_strategy(instance)
        with contextlib.ExitStack() as window:  # exits run last-entered first
            window.callback(_show_current_form, instance)
            window.enter_context(instance.group.unsharded_in_full_precision())
            full = _FullParams(instance, with_grads=options["with_grads"])
            if options["rank0_only"] and _rank_in_group(instance) != 0:
                window.close()  # gathered with the others, shown on rank 0 alone
                yield
                return
            full.show(offload_to_cpu=options["offload_to_cpu"])
            window.callback(full.hide, writeback=writeback)
            yield
    finally:
        instance.summoning = False


def _show_current_form(instance: WrapperState) -> None:
    """After a summon, show the parameters as the group now holds them: the forward's views
    of a group still unsharded, else the shards (the original parameters
    (``use_orig_params=True``) always show their shards, as torch's do)."""
    handle, group = instance.handle, instance.group
    assert handle is not None and group is not None
    if group.is_unsharded and not handle.use_orig_params:
        handle.to_unsharded()
    else:
        handle.show_sharded()


class _FullParams:
    """One instance's gathered full parameters (and gradients) during a summon."""

    def __init__(self, instance: WrapperState, *, with_grads: bool) -> None:
        assert instance.handle is not None
        self.instance = instance
        self.handle: FlatParamHandle = instance.handle
        self.rank = instance.mesh_info.shard_rank
        # The group shows the full parameters (ParamGroup.unsharded_in_full_precision).
        self.flat = self.handle.gathered  # 1-D, padded_numel, original dtype
        self.grad_flat = self._gather_grads() if with_grads else None  # same layout
        self.cpu_copy: torch.Tensor | None = None  # what the module views (offload_to_cpu)
        self.saved_grads: list[torch.Tensor | None] = []
        self.saved_flat_entries: list[tuple[str, Any]] | None = None

    # -- gradients ----------------------------------------------------------------------

    def _gather_grads(self) -> torch.Tensor | None:
        """Every rank's gradient shard, gathered; ``None`` if no rank holds one."""
        handle = self.handle
        mesh_info = self.instance.mesh_info
        grads = [p.grad for p in handle.orig_params]
        present = [g for g in grads if g is not None]
        dtype = present[0].dtype if present else handle.orig_dtype
        if mesh_info.shard_size > 1:
            missing = torch.tensor([0 if present else 1], device=handle.device)
            comms.all_reduce(missing, mesh_info.shard_group)
            if int(missing.item()) == mesh_info.shard_size:
                return None
        elif not present:
            return None
        shard = torch.zeros(handle.shard_numel, dtype=dtype, device=handle.device)
        for i, grad in enumerate(grads):
            if grad is not None:
                handle._shard_piece(shard, i).copy_(grad.reshape(-1))
        if mesh_info.shard_size == 1:
            return shard
        full = torch.empty(handle.layout.padded_numel, dtype=dtype, device=handle.device)
        comms.all_gather(full, shard, mesh_info.shard_group)
        return full

    # -- what the module shows ----------------------------------------------------------

    def show(self, *, offload_to_cpu: bool) -> None:
        handle = self.handle
        shown = self.flat.detach()
        if offload_to_cpu and shown.device.type != "cpu":
            self.cpu_copy = shown = shown.to("cpu")
        views = handle.full_views(shown)
        grad_views = handle.full_views(self.grad_flat) if self.grad_flat is not None else None
        if not handle.use_orig_params:
            wrapped = self.instance.inner  # holds the flat parameter
            self.saved_flat_entries = list(registered_parameters(wrapped).items())
            registered_parameters(wrapped).pop(FLAT_PARAM, None)
        for i, (slots, trainable) in enumerate(zip(handle.slots, handle.trainable)):
            if handle.use_orig_params:
                param = handle.orig_params[i]
                self.saved_grads.append(param.grad)
                param.grad = None
                param.data = views[i]
            else:
                param = nn.Parameter(views[i], requires_grad=trainable)
            if grad_views is not None and trainable:
                _assign_grad(param, grad_views[i])
            for slot in slots:
                _set_tensor(slot, param, unsafe=handle.unsafe_setattr)

    def hide(self, *, writeback: bool) -> None:
        handle = self.handle
        chunk = None
        if writeback:
            flat = self.cpu_copy if self.cpu_copy is not None else self.flat
            start = self.rank * handle.shard_numel
            chunk = flat.narrow(0, start, handle.shard_numel)
            with torch.no_grad():
                handle.local_shard.copy_(chunk)
        grad_chunk = None
        if writeback and self.grad_flat is not None:
            start = self.rank * handle.shard_numel
            grad_chunk = self.grad_flat.narrow(0, start, handle.shard_numel)
        if handle.use_orig_params:
            for i, (param, trainable) in enumerate(zip(handle.orig_params, handle.trainable)):
                param.grad = None
                param.data = handle.orig_piece(handle.local_shard, i)
                grad = self.saved_grads[i]
                if grad_chunk is not None and trainable and param.numel():
                    piece = handle._shard_piece(grad_chunk, i)
                    grad = piece.clone() if grad is None else grad.view(-1).copy_(piece)
                if grad is not None:
                    _assign_grad(param, grad.view(param.shape))
        if self.saved_flat_entries is not None:
            wrapped = self.instance.inner
            registered_parameters(wrapped).clear()
            registered_parameters(wrapped).update(self.saved_flat_entries)


# -- apply ---------------------------------------------------------------------------------


def apply(instance: WrapperState, fn: Any, apply_module: Any) -> Any:
    """``nn.Module.apply`` with this instance's full parameters shown and written back."""
    busy = _busy_state(instance)
    if busy is not None:
        raise ValueError(
            f"apply() on {instance} expected to be in states [IDLE] but current state "
            f"is {busy}: apply() gathers the full parameters itself, so call it outside "
            "summon_full_params, forward and backward"
        )
    uninitialized = instance.is_root is None
    options = dict(writeback=True, rank0_only=False, offload_to_cpu=False, with_grads=False)
    with summon_one(instance, **options):
        result = apply_module(fn)
    if uninitialized and instance.is_root:
        instance.undo_lazy_init()  # the forward may run from another root later
    return result


# -- clip_grad_norm_ -----------------------------------------------------------------------


def clip_grad_norm(root: WrapperState, max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip every gradient under ``root`` in place; return the total norm (see the note)."""
    root.lazy_init()
    if not root.is_root:
        raise RuntimeError(
            "clip_grad_norm_() should only be called on the root FSDP instance (the outermost "
            f"FullyShardedDataParallel), not on the nested {root}"
        )
    if root.group is not None and root.group.training_state is not TrainingState.IDLE:
        raise ValueError("clip_grad_norm_() must be called outside forward and backward")
    instances = root.ctx.states
    model = root.module
    if not any(_uses_sharded_strategy(i) for i in instances if i.handle is not None):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    max_norm, norm_type = float(max_norm), float(norm_type)
    sharded: dict[int, nn.Parameter] = {}
    replicated: dict[int, nn.Parameter] = {}
    for instance in instances:
        handle = instance.handle
        if handle is None:
            continue
        target = sharded if _uses_sharded_strategy(instance) else replicated
        params = handle.orig_params if handle.use_orig_params else [handle.flat_param]
        for param in params:
            target.setdefault(id(param), param)
    for param in model.parameters():  # ignored or otherwise unmanaged: whole on every rank
        if id(param) not in sharded and id(param) not in replicated:
            replicated[id(param)] = param
    grads = [p.grad for p in [*sharded.values(), *replicated.values()] if p.grad is not None]
    device = root.device
    sharded_norm = _local_norm(sharded.values(), norm_type, device)
    replicated_norm = _local_norm(replicated.values(), norm_type, device) if replicated else None
    group = root.process_group
    if norm_type == math.inf:
        total = sharded_norm
        if replicated_norm is not None:
            total = torch.maximum(total, replicated_norm)
        comms.all_reduce(total, group, op=dist.ReduceOp.MAX)
    else:
        total = sharded_norm**norm_type
        comms.all_reduce(total, group)
        if replicated_norm is not None:
            total = total + replicated_norm**norm_type
        total = total ** (1.0 / norm_type)
    if root.config.cpu_offload.offload_params:
        total = total.cpu()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device, grad.dtype))
    if not grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {root.rank} with no gradients -- returning "
            f"the total norm in the default dtype {total.dtype}: no parameter under "
            f"{root} has a gradient on this rank, so the gradients' dtype is unknown",
            stacklevel=3,
        )
        return total
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))


def _local_norm(params: Iterable[nn.Parameter], norm_type: float, device: torch.device):
    """The p-norm (fp32) of this rank's gradients of ``params``, as one vector."""
    # An empty gradient (a parameter with no elements on this rank) adds nothing.
    grads = [p.grad.detach() for p in params if p.grad is not None and p.grad.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type).to(device)
