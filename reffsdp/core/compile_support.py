"""How reffsdp's hooks meet ``torch.compile``.

[Note: FSDP work runs outside compiled graphs]
A module compiled in place (``module.compile()``) compiles its whole ``__call__``, forward
hooks included; a module compiled as ``torch.compile(module)`` compiles only its forward.
Either way the compiled region must not contain FSDP's own work: its gathers free and
regrow parameter storage (``resize_``), its collectives run on process groups, and its
bookkeeping changes Python state per step. Traced, these would be baked into the graph
(or fail to lower, e.g. inductor on a storage resize). So, as torch's eager FSDP does,
every FSDP entry point that user code or autograd calls -- forward pre/post hooks,
pre-backward and post-backward hooks, the final callback -- runs under
:func:`run_eagerly`: when a compiled region reaches one, dynamo stops the graph there, runs
the hook as plain Python, and resumes compiling the module's own code after it.

A front end whose own code must run eagerly around a call it wants compiled (the
wrapped module's forward, say) subclasses :class:`run_eagerly` with its own
:meth:`~run_eagerly.disabled`.

Dynamo also needs to know that the parameters of sharded modules change identity between
steps (unsharded views are rebuilt, sharded tensors come back): ``mark_fsdp_managed`` sets
the attributes it reads, so it passes parameters as graph inputs instead of baking them in
as constants.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from . import torch_internals

_REASON = "FSDP hooks and collectives run eagerly (see reffsdp/core/compile_support.py)"


class run_eagerly:  # noqa: N801 (a method decorator, named like one)
    """Method decorator: the method runs outside any compiled graph, with all it calls.

    Takes effect once :func:`install_eager_methods` ran on the class (its constructor
    does); until then the method is plain. See [Note: FSDP work runs outside compiled
    graphs]. Both front ends mark their hooks with it.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Any]:
        return self.fn if obj is None else types.MethodType(self.fn, obj)

    def disabled(self) -> Callable[..., Any]:
        """The method as :func:`install_eager_methods` puts it on the class."""
        return torch.compiler.disable(self.fn, recursive=True, reason=_REASON)


def install_eager_methods(cls: type) -> None:
    """Put the dynamo-disabled versions of ``cls``'s :class:`run_eagerly` methods in place.

    Called from constructors, not at import: importing ``torch._dynamo`` (which
    ``torch.compiler.disable`` does) is slow and loads torch's own FSDP. After the first
    call, ``cls`` holds plain functions again, so looking a hook up costs what it always did
    and is never itself traced.
    """
    for name, attr in list(vars(cls).items()):
        if isinstance(attr, run_eagerly):
            setattr(cls, name, attr.disabled())


def mark_fsdp_managed(modules: Iterable[nn.Module], params_are_own: bool = True) -> None:
    """Tell ``torch.compile`` that ``modules``' parameters change between calls.

    Dynamo then passes the modules' parameters to graphs as inputs and skips guarding on
    their identity (see ``torch_internals.mark_fsdp_managed``). It refuses modules whose
    parameters are not their own (``params_are_own=False``: a front end registered others
    in their place). Both front ends call it: ``fully_shard`` on the modules it manages, the
    wrapper on the modules it wraps.
    """
    for module in modules:
        torch_internals.mark_fsdp_managed(module, params_are_own)
