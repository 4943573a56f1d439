"""The original parameters of a wrapper-API model, whole, read through what every
implementation of ``FullyShardedDataParallel`` shows: for parity checks of torch's wrapper,
or any other than reffsdp's (whose own instances :func:`reffsdp.testing.parity.unflattened_params`
reads).

[Note: reading any wrapper's parameters]
A wrapper instance is a module with a ``_fsdp_wrapped_module`` child (the wrapped module)
and a ``process_group``, the group its flat parameter is sharded over (the shard group; for
the hybrid strategies, inside a replica). The strategy fixes the rest:

* ``use_orig_params=False``: the instance's flat parameter, the parameter ``_flat_param``
  of the wrapped module, holds this rank's contiguous piece of the instance's parameters
  laid end to end in the module's order (those of nested instances left out, each parameter once),
  padded at the end to a multiple of the group's size; its gradient is laid out alike.
  The pieces are gathered over the group and cut at the parameters' sizes, which come from
  the unsharded reference (``expected_comms.flat_numel`` is the same layout's size).
* ``use_orig_params=True``: each original parameter is shown as the 1-D part of it that
  this rank's piece holds (empty on ranks whose piece misses it), its gradient alike; the
  ranks' parts, in rank order, are the parameter flattened.

Two ranks, a weight ``w`` of 3 elements and a bias ``b`` of 2 in one instance: the flat
parameter is ``[w0 w1 w2 b0 b1 pad]``, rank 0 holds ``[w0 w1 w2]``, rank 1 ``[b0 b1 pad]``;
with ``use_orig_params=True`` rank 0 shows ``w`` as ``[w0 w1 w2]`` and ``b`` as ``[]``.

Everything is gathered with plain ``torch.distributed`` calls, so a bug planted in an
implementation's collectives does not reach the checker. Every rank calls this together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

WRAPPED_MODULE = "_fsdp_wrapped_module"
FLAT_PARAM = "_flat_param"

Entries = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


def wrapped_params(
    model: nn.Module, ref_model: nn.Module, prefixes_to_ignore: Sequence[str] = ()
) -> Entries | None:
    """``{name: (full parameter, full gradient or None)}`` of ``model``, wrapped by any
    implementation's wrapper, named as ``ref_model`` (its unsharded twin) names them; or
    ``None`` when ``model`` holds no wrapper instance. See [Note: reading any wrapper's
    parameters]; a gradient is ``None`` when it is ``None`` on every rank of the group."""
    instances = {
        path: module for path, module in model.named_modules() if _is_wrapper_instance(module)
    }
    if not instances:
        return None
    prefixes = (f"{WRAPPED_MODULE}.", *prefixes_to_ignore)
    if any(name.endswith(FLAT_PARAM) for name, _ in model.named_parameters()):
        return _from_flat_params(instances, ref_model, prefixes)
    return _from_original_params(model, instances, ref_model, prefixes)


def _is_wrapper_instance(module: nn.Module) -> bool:
    return isinstance(getattr(module, WRAPPED_MODULE, None), nn.Module) and hasattr(
        module, "process_group"
    )


def _clean(name: str, prefixes: Sequence[str]) -> str:
    for prefix in prefixes:
        name = name.replace(prefix, "")
    return name.removesuffix(".")


def _from_flat_params(
    instances: dict[str, nn.Module], ref_model: nn.Module, prefixes: Sequence[str]
) -> Entries:
    names = {id(param): name for name, param in ref_model.named_parameters()}
    taken: set[int] = set()
    entries: Entries = {}
    # Deepest first: an instance's flat parameter leaves out what nested instances hold.
    for path in sorted(instances, key=lambda path: -path.count(".") - bool(path)):
        instance = instances[path]
        ref_module = ref_model.get_submodule(_clean(path, prefixes))
        owned = [p for p in ref_module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in owned)
        wrapped = getattr(instance, WRAPPED_MODULE)
        flat = dict(wrapped.named_parameters(recurse=False)).get(FLAT_PARAM)
        if flat is None:
            if owned:
                raise ValueError(f"wrapper instance {path!r} holds no {FLAT_PARAM}")
            continue
        group = instance.process_group
        full = _gather(flat.detach(), group)
        grad = _gather_grad(flat, group)
        numels = [p.numel() for p in owned]
        if sum(numels) > full.numel():
            raise ValueError(
                f"the flat parameter of wrapper instance {path!r} holds {full.numel()} "
                f"elements, fewer than its {len(owned)} parameters' {sum(numels)}"
            )
        offset = 0
        for param, numel in zip(owned, numels):
            piece = slice(offset, offset + numel)
            offset += numel
            whole_grad = None if grad is None else grad[piece].view(param.shape)
            entries[names[id(param)]] = (full[piece].view(param.shape), whole_grad)
    return entries


def _from_original_params(
    model: nn.Module,
    instances: dict[str, nn.Module],
    ref_model: nn.Module,
    prefixes: Sequence[str],
) -> Entries:
    shapes = {name: param.shape for name, param in ref_model.named_parameters()}
    entries: Entries = {}
    for name, param in model.named_parameters():
        clean = _clean(name, prefixes)
        owner = max((path for path in instances if _inside(name, path)), key=len, default=None)
        if owner is None:  # outside every instance: not sharded
            entries[clean] = (param.detach(), None if param.grad is None else param.grad.detach())
            continue
        group = instances[owner].process_group
        whole = _gather_uneven(param.detach().reshape(-1), group)
        grad = None
        if _any_rank(param.grad is not None, group):
            local = torch.zeros_like(param) if param.grad is None else param.grad.detach()
            grad = _gather_uneven(local.reshape(-1), group)
        if clean in shapes and whole.numel() == shapes[clean].numel():
            whole = whole.view(shapes[clean])
            grad = None if grad is None else grad.view(shapes[clean])
        entries[clean] = (whole, grad)  # another size shows as a shape mismatch
    return entries


def _inside(name: str, path: str) -> bool:
    return not path or name.startswith(f"{path}.")


def _gather(shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ranks' equal pieces, end to end (on the device ``shard`` is on)."""
    if group is None or dist.get_world_size(group) == 1:
        return shard.reshape(-1).clone()
    local = shard.reshape(-1).to(_comm_device(group))
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    return torch.cat(pieces).to(shard.device)


def _gather_grad(flat: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """The flat gradient, whole (zeros for ranks without one), or ``None`` when no rank
    of the group has one."""
    if not _any_rank(flat.grad is not None, group):
        return None
    local = torch.zeros_like(flat) if flat.grad is None else flat.grad.detach()
    return _gather(local.to(flat.device), group)


def _gather_uneven(part: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ranks' 1-D parts of different sizes, end to end in rank order."""
    if group is None or dist.get_world_size(group) == 1:
        return part.clone()
    size, device = dist.get_world_size(group), _comm_device(group)
    sizes = torch.zeros(size, dtype=torch.int64, device=device)
    sizes[dist.get_rank(group)] = part.numel()
    dist.all_reduce(sizes, group=group)
    padded = torch.zeros(int(sizes.max()), dtype=part.dtype, device=device)
    padded[: part.numel()] = part
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    pieces = [piece[:count] for piece, count in zip(gathered, sizes.tolist())]
    return torch.cat(pieces).to(part.device)


def _any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    if group is None or dist.get_world_size(group) == 1:
        return flag
    value = torch.tensor([float(flag)], device=_comm_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group``'s collectives take their tensors: NCCL moves CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
