"""Gradient communication algorithms for the wrapper API.

Mirrors ``torch.distributed.algorithms._comm_hooks``: :mod:`.default_hooks` (also reachable
as ``default``) holds the built-in hooks, and ``LOW_PRECISION_HOOKS`` lists the hooks that
choose their own communication dtype (the wrapper hands them gradients uncast).
"""

from . import default_hooks
from . import default_hooks as default

LOW_PRECISION_HOOKS = [
    default_hooks.fp16_compress_hook,
    default_hooks.bf16_compress_hook,
]

__all__ = ["LOW_PRECISION_HOOKS", "default", "default_hooks"]
