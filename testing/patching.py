"""Wrap, delay, inspect or replace the collectives reffsdp issues, from a test.

Each helper routes one kind of collective, for the calling rank and while its context is
open, to ``fn``. ``fn`` takes exactly the arguments of the torch function it stands in for
and may call that function to let the collective through::

    from reffsdp.core import comms

    def slow_all_gather(output, input, group=None, async_op=False):
        time.sleep(0.1)  # e.g. to expose a missing wait on the all-gather stream
        return comms.torch_all_gather()(output, input, group=group, async_op=async_op)

    with patch_all_gather(slow_all_gather):
        model(inp).sum().backward()

They are thin wrappers over :func:`reffsdp.core.comms.intercept`, so they see every
collective reffsdp issues and nothing else: a plain ``torch.distributed`` call in a test is
not redirected. Unlike torch's own patch helpers they swap no module global, so they need
no barrier and no rank can see another rank's function: under the threaded process group
each rank thread patches only its own calls (see [Note: interception is per rank] in
``reffsdp/core/comms.py``). Every rank that should be patched enters the context itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from reffsdp.core.comms import Collective, intercept, torch_all_gather, torch_reduce_scatter


def patch_all_gather(fn: Callable[..., Any]) -> AbstractContextManager[None]:
    """Route this rank's all-gathers to ``fn(output, input, group=, async_op=)``.

    ``fn`` stands in for ``comms.torch_all_gather()`` (``dist.all_gather_single``, or
    ``dist.all_gather_into_tensor`` before torch 2.13).
    """
    return intercept(Collective.ALL_GATHER, fn)


def patch_reduce_scatter(fn: Callable[..., Any]) -> AbstractContextManager[None]:
    """Route this rank's reduce-scatters to ``fn(output, input, op=, group=, async_op=)``.

    ``fn`` stands in for ``comms.torch_reduce_scatter()`` (``dist.reduce_scatter_single``,
    or ``dist.reduce_scatter_tensor`` before torch 2.13).
    """
    return intercept(Collective.REDUCE_SCATTER, fn)


def patch_all_reduce(fn: Callable[..., Any]) -> AbstractContextManager[None]:
    """Route this rank's all-reduces to ``fn(tensor, op=, group=, async_op=)``.

    ``fn`` stands in for ``dist.all_reduce``.
    """
    return intercept(Collective.ALL_REDUCE, fn)


def patch_broadcast(fn: Callable[..., Any]) -> AbstractContextManager[None]:
    """Route this rank's broadcasts to ``fn(tensor, src=, group=, async_op=)``.

    ``fn`` stands in for ``dist.broadcast``.
    """
    return intercept(Collective.BROADCAST, fn)


def observe_all_gathers(
    observer: Callable[[torch.Tensor, torch.Tensor, Any], None],
) -> AbstractContextManager[None]:
    """Call ``observer(output, input, group)`` at each of this rank's reffsdp all-gathers.

    The observer runs just before the collective, which then runs unchanged. For tests that
    record what is gathered, over which group, or what has happened by then.
    """

    def observed(output, input, group=None, async_op=False):
        observer(output, input, group)
        return torch_all_gather()(output, input, group=group, async_op=async_op)

    return patch_all_gather(observed)


def observe_reduce_scatters(
    observer: Callable[[torch.Tensor, torch.Tensor, Any, Any], None],
) -> AbstractContextManager[None]:
    """Call ``observer(output, input, op, group)`` at each of this rank's reffsdp
    reduce-scatters, just before the collective, which then runs unchanged."""

    def observed(output, input, op=None, group=None, async_op=False):
        observer(output, input, op, group)
        return torch_reduce_scatter()(output, input, op=op, group=group, async_op=async_op)

    return patch_reduce_scatter(observed)


@contextlib.contextmanager
def count_all_gathers() -> Iterator[list[int]]:
    """Count the all-gathers reffsdp issues on this rank; yields ``[count]``, kept current.

    Unlike :class:`~reffsdp.testing.CommCounter` this sees only reffsdp's own all-gathers,
    not those of DTensor or of a parity check running alongside.
    """
    count = [0]

    def counting(output, input, group):
        count[0] += 1

    with observe_all_gathers(counting):
        yield count
