"""Benchmarks of reffsdp against torch's FSDP, DDP and a local baseline.

Run ``python -m reffsdp.bench --help``. Like the rest of reffsdp it never imports torch's
FSDP: torch's implementations, the reference, are built in
``tests/benchmarks/torch_reference.py``, loaded from a source checkout (see ``impls``).
"""

from .cli import main

__all__ = ["main"]
