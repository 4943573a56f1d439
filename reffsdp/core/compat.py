"""What differs between the torch releases reffsdp supports, decided here once.

reffsdp runs on every torch from 2.11 to 2.15. Where those releases differ in something
reffsdp touches, this module owns the difference: every other module
asks a function here instead of comparing versions or probing torch with ``hasattr``. Each
entry names the releases on each side.

[Note: torch versions]

====  =================================================================  =======  =======
 #    difference                                                         before   from
====  =================================================================  =======  =======
 1    ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (the   --       2.13
      older ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` warn
      from 2.13 on)
 2    a ``PREMUL_SUM`` ``ReduceOp`` shows its factor (``op.factor``)     --       2.13
 3    (moved: entry H1 of ``reffsdp.testing.torch_private``, DTensor's
      fake-mode lock for threaded runs)
 4    (moved: entry H2 of ``reffsdp.testing.torch_private``, the flight
      recorder a Python-only group cannot take)
 5    ``fully_shard`` with ``reduce_dtype=None`` reduces gradients in    param    grad
      the parameter's gradient dtype, no longer in ``param_dtype``       dtype    dtype
                                                                         (2.14)   (2.15)
 6    (moved: entry H3 of ``reffsdp.testing.torch_private``, the fake
      group's reduce-scatter output)
 7    ``fully_shard`` asks an all-gather extension whether to free the  --       2.15
      gathered outputs once its post hook built the unsharded form
      (``fsdp_should_release_all_gather_outputs_after_post_all_gather``)
 8    torch's own ``fully_shard`` takes per-parameter meshes             --       2.12
      (``shard_placement_fn`` returning a ``ShardPlacementResult``) and
      SPMD meshes (``dp_mesh_dims``), and its ``FSDPModule`` has
      ``set_symm_mem_for_comm``; reffsdp offers all three on every
      release, so only tests that compare with torch's depend on it
====  =================================================================  =======  =======

Differences only the testing package meets (threaded runs, the fake group) are entries
H1-H3 of [Note: torch versions of the harness] in ``reffsdp.testing.torch_private``; the
numbers of the entries that moved there stay taken, so "entry 5" keeps meaning one thing.
The tests import :data:`TORCH_VERSION` to compare with the installed torch's own behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _parse_version(text: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``.

    >>> _parse_version("2.15.0+cu132"), _parse_version("2.12.1")
    ((2, 15), (2, 12))
    """
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _parse_version(torch.__version__)
"""The installed torch's (major, minor) release."""

OLDEST_SUPPORTED = (2, 11)
NEWEST_TESTED = (2, 15)


# 1. Collective names. -----------------------------------------------------------------------


def all_gather_single() -> Callable[..., Any]:
    """``dist.all_gather_single`` (2.13+), else ``dist.all_gather_into_tensor``.

    Looked up on ``torch.distributed`` at each call, so a test that patches the module still
    sees reffsdp's calls.
    """
    if TORCH_VERSION >= (2, 13):
        return dist.all_gather_single
    return dist.all_gather_into_tensor


def reduce_scatter_single() -> Callable[..., Any]:
    """``dist.reduce_scatter_single`` (2.13+), else ``dist.reduce_scatter_tensor``."""
    if TORCH_VERSION >= (2, 13):
        return dist.reduce_scatter_single
    return dist.reduce_scatter_tensor


# 2. PREMUL_SUM. ---------------------------------------------------------------------------


PREMUL_SUM_FACTOR_READABLE = TORCH_VERSION >= (2, 13)
"""Whether a ``PREMUL_SUM`` op carries its factor where Python can read it (entry 2).

Before 2.13 the factor lives only inside the C++ op, so a process group written in Python
cannot carry out ``PREMUL_SUM``."""


def premul_sum_factor(op: dist.ReduceOp) -> float | torch.Tensor:
    """The factor of a ``PREMUL_SUM`` op; ``NotImplementedError`` before torch 2.13."""
    if not PREMUL_SUM_FACTOR_READABLE:
        raise NotImplementedError(
            f"torch {torch.__version__} does not expose a PREMUL_SUM op's factor to Python "
            "(torch 2.13 and newer do), so a Python process group cannot apply it"
        )
    return op.factor


# 5. The default gradient-reduction dtype of fully_shard. -------------------------------------


def fully_shard_default_reduce_dtype(
    param_dtype: torch.dtype | None, grad_dtype: torch.dtype
) -> torch.dtype:
    """The dtype ``fully_shard`` reduces a gradient in when ``reduce_dtype`` is not set.

    ``param_dtype`` is the parameter's compute cast (the policy's, or what its
    ``param_dtype_override_fn`` chose; ``None``: no cast), ``grad_dtype`` the sharded
    parameter's gradient dtype (its own dtype). Up to torch 2.14 gradients are reduced in
    the dtype they were computed in, ``param_dtype``; from 2.15 in ``grad_dtype`` (entry 5).
    It is also the dtype gradients are kept in while gradient sync is off. Asked by
    ``ShardedParam.lazy_init`` (``reffsdp/per_param/sharded_param.py``). The wrapper API
    keeps reducing in ``param_dtype`` on every release, as torch's does.

    >>> import torch
    >>> fully_shard_default_reduce_dtype(None, torch.float32)
    torch.float32
    """
    if param_dtype is None or TORCH_VERSION >= (2, 15):
        return grad_dtype
    return param_dtype


# 7. The all-gather extension contract. -------------------------------------------------------

EXTENSIONS_MAY_RELEASE_OUTPUTS = TORCH_VERSION >= (2, 15)
"""Whether ``fully_shard`` asks a parameter's all-gather extension if its gathered outputs may
be freed right after its post hook (entry 7; see [Note: all-gather extensions] in
``reffsdp/per_param/extensions.py``)."""


# 8. What torch's own fully_shard offers. -----------------------------------------------------

TORCH_FULLY_SHARD_HAS_PER_PARAM_MESHES = TORCH_VERSION >= (2, 12)
"""Whether torch's ``fully_shard`` accepts a ``ShardPlacementResult`` from
``shard_placement_fn``, takes ``dp_mesh_dims`` and has ``set_symm_mem_for_comm`` (entry 8).

reffsdp does all three on every release; tests that compare with torch's own run only where
this is true."""
