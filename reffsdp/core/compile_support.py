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

The wrapper API runs FSDP work inside its own ``forward`` around the call of the wrapped
module. That forward is a :class:`run_frame_eagerly` method: its own code runs eagerly,
but the wrapped module it calls is still compiled (when the user compiled it).

Dynamo also needs to know that the parameters of sharded modules change identity between
steps (unsharded views are rebuilt, sharded tensors come back): ``mark_fsdp_managed`` sets
the attributes it reads, so it passes parameters as graph inputs instead of baking them in
as constants.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

_REASON = "FSDP hooks and collectives run eagerly (see reffsdp/core/compile_support.py)"


class run_eagerly:  # noqa: N801 (a method decorator, named like one)
    """Method decorator: the method runs outside any compiled graph, with all it calls.

    Takes effect once :func:`install_eager_methods` ran on the class (its constructor
    does); until then the method is plain. See [Note: FSDP work runs outside compiled
    graphs].
    """

    recursive = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Any]:
        return self.fn if obj is None else types.MethodType(self.fn, obj)


class run_frame_eagerly(run_eagerly):  # noqa: N801
    """Method decorator: the method's own code runs outside compiled graphs, but the
    functions it calls may be compiled (a user's compiled module, say)."""

    recursive = False


def install_eager_methods(cls: type) -> None:
    """Put the dynamo-disabled versions of ``cls``'s :class:`run_eagerly` methods in place.

    Called from constructors, not at import: importing ``torch._dynamo`` is slow and loads
    torch's own FSDP. After the first call, ``cls`` holds plain functions again, so looking
    a hook up costs what it always did and is never itself traced.
    """
    marked = {name: attr for name, attr in vars(cls).items() if isinstance(attr, run_eagerly)}
    if not marked:
        return
    import torch._dynamo
    import torch._dynamo.decorators

    kwargs: dict[str, Any] = {}
    if "reason" in inspect.signature(torch._dynamo.disable).parameters:  # torch 2.7+
        kwargs["reason"] = _REASON
    for name, attr in marked.items():
        if attr.recursive:
            setattr(cls, name, torch._dynamo.disable(attr.fn, recursive=True, **kwargs))
        else:
            # ``disable(recursive=False)`` would skip only its own wrapper's frame; ``skip``
            # marks the function itself, in place.
            setattr(cls, name, torch._dynamo.decorators.skip(attr.fn))


def mark_fsdp_managed(modules: Iterable[nn.Module], use_orig_params: bool = True) -> None:
    """Tell ``torch.compile`` that ``modules``' parameters change between calls.

    Dynamo reads these two attributes (torch's FSDP sets them too): it then passes the
    modules' parameters to graphs as inputs and skips guarding on their identity. It refuses
    ``use_orig_params=False`` modules, whose parameters are not the modules' own.
    """
    for module in modules:
        module._is_fsdp_managed_module = True  # type: ignore[attr-defined]
        module._fsdp_use_orig_params = use_orig_params  # type: ignore[attr-defined]


def call_through_wrappers(root: nn.Module, wrapper_cls: type[nn.Module]) -> None:
    """Make each ``torch.compile(block)`` in ``root`` call the wrapper auto-wrap put inside it.

    Auto-wrapping replaces a compiled block's ``_orig_mod`` child with the wrapper, but the
    compiled module still calls the block it was built around, bypassing the wrapper (its
    parameters stay sharded). Rebuilding its call on the wrapper gives what compiling the
    wrapped block gives. Torch versions without the hook to do so get a clear error.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    for path, module in root.named_modules():
        if not isinstance(module, OptimizedModule):
            continue
        wrapper = module._modules.get("_orig_mod")
        if not isinstance(wrapper, wrapper_cls) or module.__dict__.get("_orig_mod") is wrapper:
            continue
        if not hasattr(module, "_initialize"):
            raise ValueError(
                f"{path or 'the root module'} was compiled with torch.compile before "
                f"{wrapper_cls.__name__} wrapped the module inside it, so it would call the "
                "module without its wrapper. Compile after wrapping (compile the wrapped "
                "blocks), or compile in place before wrapping (block.compile())"
            )
        object.__setattr__(module, "_orig_mod", wrapper)
        module._initialize()
