"""Symmetric memory for all-gathers: ``FSDPModule.set_symm_mem_for_comm``.

[Note: symmetric memory]
A buffer in symmetric memory sits at the same place on every rank of a group, so NCCL can
all-gather into it with its copy engines (one node, a zero-CTA communicator) or its
symmetric kernels (several nodes). ``set_symm_mem_for_comm(backend)`` makes a module's
all-gathers use such buffers, as torch's does:

1. It checks that no other all-gather was installed: after ``set_custom_all_gather`` or
   ``set_allocate_memory_from_process_group_for_comm(True)`` it raises torch's
   ``AssertionError`` ("cannot call set_symm_mem() when all gather comm is custom").
2. It selects ``backend`` for torch's symmetric memory, process-wide. A build without that
   backend refuses with a ``RuntimeError``: torch's CPU wheels have none, so on them the
   call raises and the module keeps its ordinary all-gathers.
3. Only then, as in torch, a custom reduce-scatter (``set_custom_reduce_scatter``) is
   refused with ``AssertionError`` ("... when reduce scatter comm is custom"); so a CPU
   build says ``RuntimeError`` first for it, as torch's does. Nothing is changed by a
   refusal (torch has switched the all-gather and met the ranks before this one).
4. Each group meets its ranks once (a barrier over the all-gather group), so that the
   communicator exists before the first rendezvous.
5. From then on each all-gather's output comes from the device's symmetric-memory pool
   (:class:`SymmMemAllGather`) and is rendezvoused over the group before the collective; the
   pool hands the same buffer back, so only its first rendezvous costs. On a CPU mesh the
   pool has no backend: with a CUDA build the call is accepted and the first all-gather
   raises ``RuntimeError``, as torch's does. Set afterwards, ``set_custom_all_gather``
   replaces it, and ``set_allocate_memory_from_process_group_for_comm`` refuses, as in torch.

Where reffsdp differs: with sum-only reductions set before the call
(``set_force_sum_reduction_for_comms(True)``), torch also takes the reduce-scatter's input
and output from symmetric memory (NCCL's symmetric reduce-scatter supports only SUM), and
then refuses ``set_reduce_scatter_max_input_buffers(>1)`` at its first forward. reffsdp
keeps its ordinary reduce-scatter: the core allocates the reduce-scatter's output itself,
not through the comm, and a symmetric collective needs both buffers registered. And torch
skips the all-gather of a one-rank group altogether, so it never reaches the pool there;
reffsdp still copies through the comm's buffer, so on a CPU mesh of a CUDA build a
one-rank group raises at its first all-gather.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.distributed as dist

from ..core import comms, torch_internals
from ..core.param_group import ParamGroup


class SymmetricMemory(Protocol):
    """Where symmetric buffers come from: torch's symmetric memory, or a test's stand-in."""

    def pool(self, device: torch.device) -> AbstractContextManager[None]:
        """Allocate ``device`` tensors from the symmetric-memory pool for the duration."""
        ...

    def rendezvous(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Exchange ``tensor``'s handles with the group's ranks."""
        ...


class TorchSymmetricMemory:
    """torch's symmetric memory (``torch.distributed._symmetric_memory``)."""

    def pool(self, device: torch.device) -> AbstractContextManager[None]:
        return torch_internals.symm_mem_pool(device)

    def rendezvous(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        torch_internals.symm_mem_rendezvous(tensor, group)


class SymmMemAllGather(comms.AllGather):
    """All-gathers into buffers of symmetric memory (rule 5 of [Note: symmetric memory]).

    The collective itself is the ordinary one, issued through ``comms`` like every other;
    the backend sees the registered buffer and picks its symmetric algorithm.
    """

    def __init__(self, memory: SymmetricMemory | None = None) -> None:
        self.memory = memory if memory is not None else TorchSymmetricMemory()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        try:
            with self.memory.pool(device):
                return torch.empty(*size, dtype=dtype, device=device)
        except RuntimeError as error:
            raise RuntimeError(
                f"set_symm_mem_for_comm: no symmetric memory for the all-gather buffer on "
                f"{device}: {error}. Symmetric memory needs an accelerator mesh (e.g. CUDA "
                "with NCCL); on this mesh leave the default all-gather"
            ) from error

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.memory.rendezvous(output_tensor, group)  # the gather writes in place
        return comms.all_gather(output_tensor, input_tensor, group, async_op=async_op)

    def __repr__(self) -> str:
        return "SymmMemAllGather()"


def use_for_all_gathers(
    groups: list[ParamGroup], backend: str, *, allocating_from_process_group: bool
) -> None:
    """Rules 1 to 4 of [Note: symmetric memory] for ``groups`` (a module's), then rule 5."""
    for group in groups:
        _check_no_other_all_gather(group, allocating_from_process_group)
    try:
        torch_internals.set_symm_mem_backend(backend)
    except RuntimeError as error:
        raise RuntimeError(
            f"set_symm_mem_for_comm({backend!r}): {error}; this torch build "
            f"({torch.__version__}) has no {backend!r} symmetric-memory backend (CPU builds "
            "have none). Nothing was changed: the all-gathers stay the ordinary ones"
        ) from error
    for group in groups:
        _check_no_custom_reduce_scatter(group)
    for group in groups:
        comms.barrier(_all_gather_group(group))
        group.configure(all_gather_comm=SymmMemAllGather())


def _check_no_other_all_gather(group: ParamGroup, allocating_from_process_group: bool) -> None:
    all_gather = group.settings.all_gather_comm
    if allocating_from_process_group:
        all_gather_kind = "ProcessGroupAllocAllGather"
    elif all_gather is not None and not isinstance(all_gather, SymmMemAllGather):
        all_gather_kind = type(all_gather).__name__
    else:
        all_gather_kind = None
    if all_gather_kind is not None:
        raise AssertionError(
            f"cannot call set_symm_mem() when all gather comm is custom: {all_gather_kind} "
            f"({group.name}); symmetric memory replaces the all-gather's buffers, so it "
            "cannot be combined with another all-gather"
        )


def _check_no_custom_reduce_scatter(group: ParamGroup) -> None:
    reduce_scatter = group.settings.reduce_scatter_comm
    if reduce_scatter is not None:
        raise AssertionError(
            "cannot call set_symm_mem() when reduce scatter comm is custom: "
            f"{type(reduce_scatter).__name__} ({group.name}); set_symm_mem_for_comm cannot "
            "be combined with set_custom_reduce_scatter"
        )


def _all_gather_group(group: ParamGroup) -> dist.ProcessGroup:
    shard_group = group.mesh_info.shard_group
    if shard_group is None:
        raise AssertionError(
            f"set_symm_mem_for_comm: {group.name} shards over no mesh dim (dp_mesh_dims names "
            "replicate dims only), so it has no all-gather to give symmetric memory"
        )
    return shard_group
