"""Named ranges for the phases of an iteration, for ``torch.profiler`` traces.

The core marks where it copies shards in (``copy-in``), waits for an all-gather
(``all-gather``), copies gathered parameters out (``copy-out``) and reduce-scatters
gradients (``reduce-scatter``), so a Chrome trace of a training step shows them by name.
A range is opened only while a profiler runs; otherwise :func:`phase` returns a shared
no-op context and :func:`in_phase` calls straight through, so unprofiled steps pay one
flag check per phase.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def phase(name: str) -> Any:
    """A context naming the code it wraps ``name`` in a running profiler's trace."""
    if profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_RANGE


def in_phase(name: str) -> Callable[[_F], _F]:
    """Decorate a function so that every call of it is a ``name`` range (see :func:`phase`)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not profiler_enabled():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
