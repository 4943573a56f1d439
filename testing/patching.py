"""Wrap, delay, inspect or replace the collectives reffsdp issues, from a test.

Each helper routes one kind of collective, for the calling rank and while its context is
open, to ``fn``. ``fn`` takes exactly the arguments of the torch function it stands in for
and may call that function to let the collective through::

    from reffsdp.core import compat

    def slow_all_gather(output, input, group=None, async_op=False):
        time.sleep(0.1)  # e.g. to expose a missing wait on the all-gather stream
        return compat.all_gather_single()(output, input, group=group, async_op=async_op)

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from reffsdp.core import comms, compat
from reffsdp.core.comms import Collective, intercept


def patch_all_gather(fn: Callable[..., Any]) -> AbstractContextManager[None]:
    """Route this rank's all-gathers to ``fn(output, input, group=, async_op=)``.

    ``fn`` stands in for ``compat.all_gather_single()`` (``dist.all_gather_single``, or
    ``dist.all_gather_into_tensor`` before torch 2.13).
    """
    return intercept(Collective.ALL_GATHER, fn)


def patch_reduce_scatter(fn: Callable[..., Any]) -> AbstractContextManager[None]:
    """Route this rank's reduce-scatters to ``fn(output, input, op=, group=, async_op=)``.

    ``fn`` stands in for ``compat.reduce_scatter_single()`` (``dist.reduce_scatter_single``,
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
        return compat.all_gather_single()(output, input, group=group, async_op=async_op)

    return patch_all_gather(observed)


def observe_reduce_scatters(
    observer: Callable[[torch.Tensor, torch.Tensor, Any, Any], None],
) -> AbstractContextManager[None]:
    """Call ``observer(output, input, op, group)`` at each of this rank's reffsdp
    reduce-scatters, just before the collective, which then runs unchanged."""

    def observed(output, input, op=None, group=None, async_op=False):
        observer(output, input, op, group)
        return compat.reduce_scatter_single()(output, input, op=op, group=group, async_op=async_op)

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


@contextlib.contextmanager
def observe_collectives(
    observer: Callable[[Collective, torch.Tensor, Any], None],
    kinds: Sequence[Collective] = (
        Collective.ALL_GATHER,
        Collective.REDUCE_SCATTER,
        Collective.ALL_REDUCE,
    ),
) -> Iterator[None]:
    """Call ``observer(kind, tensor, group)`` at each of this rank's reffsdp collectives of
    ``kinds``, then run the collective as it would have run.

    ``tensor`` is the collective's unsharded side: the all-gather output, the
    reduce-scatter input, the all-reduced tensor. Unlike the helpers above, this one passes
    each call on to whatever handled it when the context opened (another interceptor, say a
    planted bug, or torch), so it can count the collectives of a patched run too.
    """
    with contextlib.ExitStack() as stack:
        for kind in kinds:
            stack.enter_context(intercept(kind, _observed(kind, observer)))
        yield


def _observed(kind: Collective, observer: Callable[[Collective, torch.Tensor, Any], None]):
    inner = comms._resolve(kind)  # what this rank's call would reach without us
    if kind is Collective.ALL_GATHER:

        def all_gather(output, input, group=None, async_op=False):
            observer(kind, output, group)
            return inner(output, input, group=group, async_op=async_op)

        return all_gather
    if kind is Collective.REDUCE_SCATTER:

        def reduce_scatter(output, input, op=None, group=None, async_op=False):
            observer(kind, input, group)
            return inner(output, input, op=op, group=group, async_op=async_op)

        return reduce_scatter
    if kind is Collective.ALL_REDUCE:

        def all_reduce(tensor, op=None, group=None, async_op=False):
            observer(kind, tensor, group)
            return inner(tensor, op=op, group=group, async_op=async_op)

        return all_reduce
    raise ValueError(f"cannot observe {kind.value} collectives")
