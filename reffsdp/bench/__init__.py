"""Benchmarks of reffsdp against torch's FSDP, DDP and a local baseline.

Run ``python -m reffsdp.bench --help``. The one part of reffsdp that imports torch's FSDP,
lazily, as the reference being measured against (see ``impls``).
"""

from .cli import main

__all__ = ["main"]
