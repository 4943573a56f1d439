"""Run a program written against torch's FSDP on reffsdp, without an edit::

    python -m reffsdp.swap train.py --lr 0.1
    python -m reffsdp.swap -m my_project.train --lr 0.1
    torchrun --nproc-per-node 8 -m reffsdp.swap -m my_project.train

[Note: the swap]
Before the program imports anything, the public names of ``torch.distributed.fsdp`` and of
the modules a trainer imports them from (:data:`SWAPS`) are rebound to reffsdp's objects of
the same name: ``from torch.distributed.fsdp import fully_shard, FSDPModule`` then gives
reffsdp's. Swapping ``fully_shard`` alone would not do: the modules it returns are not
instances of torch's ``FSDPModule``, so a trainer's ``isinstance(module, FSDPModule)``
would silently skip them, and what it sets there (a gradient divide factor, say) would
silently not be set. With the class rebound too, the check sees reffsdp's class.

The rebinding is process-wide and for good, and said once on stderr. Only names both sides
have are rebound; torch's other names (its private modules, and anything reffsdp does not
provide) stay torch's. Code that took torch's objects before the swap (torch's own modules,
imported with ``torch.distributed.fsdp`` here) keeps them. This is the one module of reffsdp
that imports ``torch.distributed.fsdp``, and it does so only to rebind names.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from types import ModuleType

import torch.distributed._composable.fsdp
import torch.distributed.fsdp
import torch.distributed.fsdp.api
import torch.distributed.fsdp.fully_sharded_data_parallel
import torch.distributed.fsdp.sharded_grad_scaler
import torch.distributed.fsdp.wrap

import reffsdp
import reffsdp.api
import reffsdp.fully_sharded_data_parallel
import reffsdp.sharded_grad_scaler
import reffsdp.wrap

USAGE = "usage: python -m reffsdp.swap (SCRIPT | -m MODULE) [ARGS ...]"

# (torch's module, reffsdp's module whose public names replace those torch's module has)
SWAPS: tuple[tuple[ModuleType, ModuleType], ...] = (
    (torch.distributed.fsdp, reffsdp),
    (torch.distributed._composable.fsdp, reffsdp),
    (torch.distributed.fsdp.fully_sharded_data_parallel, reffsdp.fully_sharded_data_parallel),
    (torch.distributed.fsdp.wrap, reffsdp.wrap),
    (torch.distributed.fsdp.api, reffsdp.api),
    (torch.distributed.fsdp.sharded_grad_scaler, reffsdp.sharded_grad_scaler),
)


def _public_names(module: ModuleType) -> list[str]:
    names = list(module.__all__)
    if module is reffsdp:
        names.append("FlatParameter")  # importable from both packages, in neither's __all__
    return names


def swap_torch_fsdp() -> dict[str, list[str]]:
    """Rebind the names (see [Note: the swap]); the names rebound, by torch's module."""
    rebound: dict[str, list[str]] = {}
    for torch_module, ours in SWAPS:
        names = [name for name in _public_names(ours) if hasattr(torch_module, name)]
        for name in names:
            setattr(torch_module, name, getattr(ours, name))
        rebound[torch_module.__name__] = names
    return rebound


def _say(rebound: dict[str, list[str]]) -> None:
    count = sum(len(names) for names in rebound.values())
    print(
        f"reffsdp.swap: {count} public names of {', '.join(rebound)} now give reffsdp's "
        "objects, for this whole process",
        file=sys.stderr,
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Swap, then run the script or module as ``__main__`` with the arguments after it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args == ["-m"]:
        raise SystemExit(USAGE)
    _say(swap_torch_fsdp())
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        sys.argv = [module, *rest]  # runpy puts the module's file in sys.argv[0]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, rest = args[0], args[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"reffsdp.swap: no such script {script!r}\n{USAGE}")
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
