"""torch's own FSDP, ``torch.distributed.fsdp`` as installed, as an implementation under test.

``python -m reffsdp.testing --impl torch`` checks it with the scenarios that check reffsdp
(see [Note: an implementation] in :mod:`reffsdp.testing.impls`). This is the one module of
reffsdp and its testing package that imports ``torch.distributed.fsdp``: reffsdp is a clean
room and never calls torch's FSDP; here torch's FSDP is only the system under test.

What torch's FSDP needs to run the suite's scenarios is supplied here and nowhere else:

* ``device_id``: torch's ``FullyShardedDataParallel`` takes the module's device to be an
  accelerator's unless it is told otherwise, so on CPU every wrapper gets
  ``device_id=torch.device("cpu")`` (on an accelerator the suite's modules are already
  there, which is all torch's wrapper needs).

Nothing else is adapted: where torch's FSDP refuses a scenario (say CPU offload on a
machine without an accelerator), the scenario is reported as unsupported with torch's
message, and where it trains differently from DDP, or issues other collectives than the
strategy calls for, the scenario fails as it would for reffsdp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp

from . import Implementation, from_module


def _wrapper_kwargs(device: torch.device) -> dict[str, Any]:
    """torch's wrapper on CPU is told so (see the module docstring)."""
    return {"device_id": device} if device.type == "cpu" else {}


def torch_implementation() -> Implementation:
    """``torch.distributed.fsdp``, named ``torch``, with torch's version."""
    return from_module("torch", torch_fsdp, torch.__version__, wrapper_kwargs=_wrapper_kwargs)
