"""Every private torch API reffsdp uses, each behind one function that says why.

[Note: private torch APIs]
reffsdp keeps to torch's public API where one does the job. Where none does (a kernel
torch's own FSDP launches, an attribute dynamo reads, a DTensor constructor that skips a
copy), the use lives here, in one function whose docstring says why reffsdp needs it, so
that a new torch release is checked in this file. Which release needs what is decided in
``compat``; nothing here compares versions. Heavy modules (dynamo, DCP) are imported inside
the functions that need them, so importing reffsdp does not load them.

Not here, because a function cannot hold them: overrides of private methods in subclasses
(``nn.Module._apply`` in both front ends, ``GradScaler._unscale_grads_`` and
``_check_inf_per_device`` in ``sharded_grad_scaler``) and the ``super()`` calls inside them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.utils import _pytree

# -- autograd --------------------------------------------------------------------------------


def in_backward() -> bool:
    """Whether autograd runs a backward pass now: torch has no public query, and activation
    checkpointing reruns forward hooks inside one."""
    return torch._C._current_graph_task_id() != -1


def queue_final_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends: the only hook that follows
    every gradient of a pass (torch's FSDP uses it for the same)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view: an in-place op replaces a view's autograd node, hooks
    and all, and torch has no public test for a view."""
    return tensor._base is not None


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> list[Callable[[torch.Tensor], None]]:
    """The hooks ``register_post_accumulate_grad_hook`` put on ``tensor``: a reduced gradient
    bypasses AccumulateGrad, so reffsdp runs them, and torch cannot list them publicly."""
    return list((getattr(tensor, "_post_accumulate_grad_hooks", None) or {}).values())


def profiler_enabled() -> bool:
    """Whether a profiler records now: checked per phase so that unprofiled steps skip
    ``record_function``, and torch has no public cheap query."""
    return torch._C._autograd._profiler_enabled()


# -- kernels ---------------------------------------------------------------------------------


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its target in one kernel launch (the all-gather copy-in); the
    op has no public name."""
    torch._foreach_copy_(targets, sources)


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """Pad each tensor on dim 0, cut it into ``num_chunks`` and lay chunk r of every tensor
    side by side in row r of ``out`` (the reduce-scatter input), in one kernel; no public
    name."""
    torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks, out=out)


def unscale_and_check_(
    tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Multiply ``tensors`` (one device and dtype) by ``inv_scale`` in place, setting
    ``found_inf`` on an inf or NaN: ``GradScaler``'s own kernel, with no public name."""
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)


def sparse_values(tensor: torch.Tensor) -> torch.Tensor:
    """The values of a sparse tensor, coalesced or not: ``values()`` refuses an uncoalesced
    one, and a gradient is unscaled in place through them."""
    return tensor._values()


# -- collectives -----------------------------------------------------------------------------


def premul_sum(factor: float) -> dist.ReduceOp:
    """A reduce op that multiplies every input by ``factor`` and sums (a gradient divided by
    a custom factor inside the collective); only this private function builds one."""
    return dist._make_nccl_premul_sum(factor)


# -- symmetric memory (torch.distributed._symmetric_memory: documented, not public) ----------


def set_symm_mem_backend(name: str) -> None:
    """Choose the backend symmetric-memory buffers come from (process-wide, as torch's
    ``set_symm_mem_for_comm`` does): ``RuntimeError`` if this build has no such backend."""
    from torch.distributed import _symmetric_memory

    _symmetric_memory.set_backend(name)


@contextlib.contextmanager
def symm_mem_pool(device: torch.device) -> Iterator[None]:
    """Allocate ``device`` tensors from its symmetric-memory pool for the duration; the pool
    reuses its buffers, so repeated allocations need no new rendezvous."""
    from torch.distributed import _symmetric_memory

    pool = _symmetric_memory.get_mem_pool(device)
    with torch.get_device_module(device).use_mem_pool(pool):
        yield


def symm_mem_rendezvous(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Exchange the handles of ``tensor``, allocated from the symmetric-memory pool, with
    the group's ranks (a collective), so that a collective on it may use symmetric memory."""
    from torch.distributed import _symmetric_memory

    _symmetric_memory.rendezvous(tensor, group=group.group_name)


# -- DTensor and DeviceMesh ------------------------------------------------------------------


def dtensor_spec(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    size: torch.Size,
    stride: tuple[int, ...],
    dtype: torch.dtype,
) -> Any:
    """The spec of a DTensor, made once and reused by :func:`dtensor_from_spec`: wrapping a
    shard that way costs a fraction of ``DTensor.from_local`` and keeps a host shard on the
    host; the spec class is private."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(mesh, placements, TensorMeta(size, stride, dtype))


def dtensor_from_spec(local: torch.Tensor, spec: Any) -> DTensor:
    """``local`` as a DTensor with ``spec`` (from :func:`dtensor_spec`): no copy, no
    autograd node, no check; DTensor's own constructor is private."""
    return DTensor(local, spec, requires_grad=False)


def dtensor_local(dtensor: DTensor) -> torch.Tensor:
    """The tensor ``dtensor`` holds, read as an attribute. ``to_local()`` is a call that a
    functorch transform sees: inside ``torch.func.jvp`` (a first forward there runs lazy
    init) it returns a wrapper whose storage cannot be read, and lazy init compares
    storages."""
    return dtensor._local_tensor


def set_dtensor_local(dtensor: DTensor, local: torch.Tensor) -> None:
    """Make ``dtensor`` hold ``local`` in place: the parameter object must stay the same
    while its storage changes, and DTensor has no public setter."""
    dtensor._local_tensor = local


def strided_shard(dim: int, split_factor: int) -> Placement:
    """The placement of a dim that a data-parallel mesh dim shards before a tensor-parallel
    one does (see ``per_param/mesh.py``); DTensor names it privately."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def cuts_a_dim(placement: Placement) -> bool:
    """Whether ``placement`` cuts a tensor dim: a ``Shard`` or :func:`strided_shard`'s
    placement, whose private class is no ``Shard``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, (Shard, _StridedShard))


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1D mesh (with its process group) over all of ``mesh``'s dims, built once and then
    cached under ``name``: DeviceMesh has no public flatten."""
    return mesh._flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of ``meshes`` (slices of one root mesh), in order:
    DeviceMesh has no public join."""
    return DeviceMesh._concatenate(meshes)


# -- ShardedTensor (the wrapper's state dicts hold them, as torch's wrapper's do) ------------


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``ShardedTensor``, whose module is private."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def local_shard(tensor: torch.Tensor, offsets: list[int], rank: int) -> Any:
    """``tensor`` as rank ``rank``'s shard of a ``ShardedTensor``, at ``offsets``."""
    from torch.distributed._shard.sharded_tensor import Shard as LocalShard

    return LocalShard.from_tensor_and_offsets(tensor, offsets, rank)


def sharded_tensor(
    local_shards: list[Any],
    layout: list[tuple[list[int], list[int], str]],
    size: torch.Size,
    dtype: torch.dtype,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """A ``ShardedTensor`` of this rank's shards (:func:`local_shard`), given every shard's
    (offsets, sizes, placement): the public constructors all-gather that layout, which
    every rank already knows."""
    from torch.distributed._shard.sharded_tensor import (
        ShardedTensor,
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharding_spec import ShardMetadata

    shards = [ShardMetadata(offsets, sizes, place) for offsets, sizes, place in layout]
    properties = TensorProperties(dtype=dtype, requires_grad=False)
    metadata = ShardedTensorMetadata(shards, size, properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=group
    )


# -- torch.compile ---------------------------------------------------------------------------


def skip_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make dynamo run ``fn``'s own frame eagerly but still compile what it calls: the
    public ``torch.compiler.disable(recursive=False)`` skips only a wrapper's frame."""
    import torch._dynamo.decorators

    return torch._dynamo.decorators.skip(fn)


def compiled_module_child(module: nn.Module) -> nn.Module | None:
    """The child a ``torch.compile(block)`` result registers for ``block`` (``None`` for
    other modules): its class and the child's name are private."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(module, OptimizedModule):
        return None
    return module._modules.get("_orig_mod")


def call_compiled_through(compiled: nn.Module, child: nn.Module) -> None:
    """Make a ``torch.compile(block)`` result call ``child``, its registered child now: it
    keeps calling the block it was built around until its private ``_initialize`` runs."""
    if compiled.__dict__.get("_orig_mod") is child:
        return
    object.__setattr__(compiled, "_orig_mod", child)
    compiled._initialize()


def mark_fsdp_managed(module: nn.Module, params_are_own: bool) -> None:
    """Set the two attributes dynamo reads on a module FSDP manages (torch's FSDP sets them):
    it then passes the parameters to graphs as inputs, and refuses modules whose parameters
    are not their own (``params_are_own=False``)."""
    module._is_fsdp_managed_module = True  # type: ignore[attr-defined]
    module._fsdp_use_orig_params = params_are_own  # type: ignore[attr-defined]


def is_fsdp_managed(module: nn.Module) -> bool:
    """Whether :func:`mark_fsdp_managed` marked ``module``."""
    return bool(getattr(module, "_is_fsdp_managed_module", False))


def register_composable_api(module: nn.Module, api_name: str) -> None:
    """Record ``api_name`` in the registry torch's composable APIs keep on ``module``: torch's
    ``replicate`` leaves alone the parameters of modules registered as ``fully_shard``, and
    only torch's private ``contract`` module names the registry."""
    from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem

    registry = module.__dict__.setdefault(REGISTRY_KEY, {})
    registry.setdefault(api_name, RegistryItem())


# -- nn.Module -------------------------------------------------------------------------------


def registered_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own name-to-parameter dict: FSDP swaps registered parameters on every
    unshard without ``__setattr__``'s checks and cost, and tells them from attributes."""
    return module._parameters  # type: ignore[return-value]


def registered_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s own name-to-child dict: read inside ``__getattr__``, where attribute
    lookup would recurse, and to see every name a shared child is registered under."""
    return module._modules


def batch_norm_base() -> type[nn.Module]:
    """The base class of every batch norm, which ``MixedPrecision`` keeps in full precision
    by default as torch's does, matching on this private class."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
"""The child name of the module inside torch's activation-checkpoint wrapper: state dicts
are read under the unwrapped model's names, so it is looked through and cut out of names."""


def has_optimizer_in_backward(param: torch.Tensor) -> bool:
    """Whether ``param`` was handed to ``torch.distributed.optim``'s private
    ``_apply_optimizer_in_backward``, which marks it so (the wrapper refuses such
    parameters)."""
    return hasattr(param, "_in_backward_optimizers")


# -- GradScaler ------------------------------------------------------------------------------


def grad_scaler_scale(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
    """The scaler's scale as a tensor, made on ``device`` at first use: scaling a loss needs
    the tensor, and the public ``get_scale()`` gives a float (a device sync)."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)
    assert scaler._scale is not None
    return scaler._scale


def grad_scaler_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> dict[torch.device, torch.Tensor]:
    """The found-inf flags, one per device, that ``unscale_(optimizer)`` recorded: ranks
    all-reduce them to skip the same steps, and ``GradScaler`` keeps them private."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


# -- pytrees (torch has no public pytree module in every supported release) ------------------


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a nest of lists, tuples, dicts and dataclasses torch knows."""
    return _pytree.tree_leaves(tree)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``."""
    return _pytree.tree_map(fn, tree)


def tree_map_only(kind: type, fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf of type ``kind`` replaced by ``fn(leaf)``."""
    return _pytree.tree_map_only(kind, fn, tree)


# -- torch.distributed.checkpoint.state_dict -------------------------------------------------

DCP_WRAPPER_LOOKUPS = ("FSDP", "_get_module_fsdp_state_if_fully_sharded_module")
"""The module-level names DCP's state-dict functions recognise torch's wrapper by: its class
and the lookup of a module's wrapper state."""


def dcp_state_dict_module() -> ModuleType:
    """``torch.distributed.checkpoint.state_dict``, imported at first use: it imports torch's
    FSDP package, which importing reffsdp must not."""
    import importlib

    return importlib.import_module("torch.distributed.checkpoint.state_dict")


def dcp_wrapper_lookups(module: ModuleType) -> tuple[Any, Any]:
    """What DCP's ``module`` holds under :data:`DCP_WRAPPER_LOOKUPS` (``None`` where a name
    is missing): reffsdp stands its own objects in for a call, as there is no public way to
    register another wrapper."""
    wrapper_name, state_getter_name = DCP_WRAPPER_LOOKUPS
    return getattr(module, wrapper_name, None), getattr(module, state_getter_name, None)


def set_dcp_wrapper_lookups(module: ModuleType, wrapper: Any, state_getter: Any) -> None:
    """Put ``wrapper`` and ``state_getter`` under DCP's :data:`DCP_WRAPPER_LOOKUPS` names
    (see :func:`dcp_wrapper_lookups`)."""
    wrapper_name, state_getter_name = DCP_WRAPPER_LOOKUPS
    setattr(module, wrapper_name, wrapper)
    setattr(module, state_getter_name, state_getter)
