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

from ..core import torch_internals
from ..core.compile_support import run_eagerly


class run_frame_eagerly(run_eagerly):  # noqa: N801 (a method decorator, named like one)
    """Method decorator: the method's own code runs outside compiled graphs, but the
    functions it calls may be compiled (a user's compiled module, say)."""

    def disabled(self) -> Callable[..., Any]:
        return torch_internals.skip_frame(self.fn)


def call_through_wrappers(root: nn.Module, wrapper_cls: type[nn.Module]) -> None:
    """Make each ``torch.compile(block)`` in ``root`` call the wrapper auto-wrap put inside it.

    Auto-wrapping replaces a compiled block's registered child with the wrapper, but the
    compiled module still calls the block it was built around, bypassing the wrapper (its
    parameters stay sharded). Rebuilding its call on the wrapper gives what compiling the
    wrapped block gives.
    """
    for module in root.modules():
        child = torch_internals.compiled_module_child(module)
        if isinstance(child, wrapper_cls):
            torch_internals.call_compiled_through(module, child)
