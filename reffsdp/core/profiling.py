"""Named ranges for the phases of an iteration, for ``torch.profiler`` traces.

The core marks where it copies shards in (``copy-in``), waits for an all-gather
(``all-gather``), copies gathered parameters out (``copy-out``) and reduce-scatters
gradients (``reduce-scatter``), so a Chrome trace of a training step shows them by name.
A range is opened only while a profiler runs, or handed to an observer while one is
installed (:func:`observe_phases`; the simulated streams of ``reffsdp.testing`` name their
trace's slices with it); otherwise :func:`phase` returns a shared no-op context and
:func:`in_phase` calls straight through, so unprofiled steps pay two checks per phase.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch

from .torch_internals import profiler_enabled

_F = TypeVar("_F", bound=Callable[..., Any])


class _NoRange:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: Any) -> None:
        return None


_NO_RANGE = _NoRange()


# Called with a phase's name for a context around it, while installed (see
# [Note: process-wide state] in ``reffsdp``).
_observer: Callable[[str], AbstractContextManager[Any]] | None = None


def phase(name: str) -> Any:
    """A context naming the code it wraps ``name`` in a running profiler's trace."""
    if profiler_enabled():
        return torch.profiler.record_function(name)
    if _observer is not None:
        return _observer(name)
    return _NO_RANGE


@contextlib.contextmanager
def observe_phases(observer: Callable[[str], AbstractContextManager[Any]]) -> Iterator[None]:
    """Wrap every phase in ``observer(name)`` inside the block (one observer at a time)."""
    global _observer
    if _observer is not None:
        raise RuntimeError("phases are observed already; observers do not nest")
    _observer = observer
    try:
        yield
    finally:
        _observer = None


def in_phase(name: str) -> Callable[[_F], _F]:
    """Decorate a function so that every call of it is a ``name`` range (see :func:`phase`)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _observer is None and not profiler_enabled():
                return fn(*args, **kwargs)
            with phase(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
