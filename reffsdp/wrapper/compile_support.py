"""How the wrapper API meets ``torch.compile``, beyond what both front ends share.

[Note: the wrapper's forward under compile]
The wrapper runs FSDP work inside its own ``forward``, around the call of the wrapped
module. That forward is a :class:`run_frame_eagerly` method: its own code runs eagerly (see
[Note: FSDP work runs outside compiled graphs] in ``core/compile_support.py``), but the
wrapped module it calls is still compiled when the user compiled it.

Auto-wrapping may put a wrapper inside a block compiled before it as ``torch.compile(block)``:
:func:`call_through_wrappers` makes the compiled block call the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from ..core.compile_support import run_eagerly


class run_frame_eagerly(run_eagerly):  # noqa: N801 (a method decorator, named like one)
    """Method decorator: the method's own code runs outside compiled graphs, but the
    functions it calls may be compiled (a user's compiled module, say)."""

    def disabled(self) -> Callable[..., Any]:
        # ``disable(recursive=False)`` would skip only its own wrapper's frame; ``skip``
        # marks the function itself, in place.
        import torch._dynamo.decorators

        return torch._dynamo.decorators.skip(self.fn)


def call_through_wrappers(root: nn.Module, wrapper_cls: type[nn.Module]) -> None:
    """Make each ``torch.compile(block)`` in ``root`` call the wrapper auto-wrap put inside it.

    Auto-wrapping replaces a compiled block's registered child with the wrapper, but the
    compiled module still calls the block it was built around, bypassing the wrapper (its
    parameters stay sharded). Rebuilding its call on the wrapper gives what compiling the
    wrapped block gives.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    for module in root.modules():
        if not isinstance(module, OptimizedModule):
            continue
        wrapper = module._modules.get("_orig_mod")
        if not isinstance(wrapper, wrapper_cls) or module.__dict__.get("_orig_mod") is wrapper:
            continue
        object.__setattr__(module, "_orig_mod", wrapper)
        module._initialize()
