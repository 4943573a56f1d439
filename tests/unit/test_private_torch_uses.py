"""Private torch names are used only in the two modules that wrap them.

reffsdp calls torch's private APIs through ``reffsdp/core/torch_internals.py`` (the swap
module, ``reffsdp/swap.py``, which stands reffsdp in for torch's FSDP, names torch's private
modules by design), and the testing package through ``testing/torch_private.py``
(``testing/impls/torch_fsdp.py`` presents torch's own FSDP and may use its insides). The scan
reads each file's syntax tree: a private name is a dotted name that resolves to a torch
module or object and has a component with a leading underscore (``torch._C.fork``,
``dist.Backend._plugins``, ``from torch.utils._pytree import ...``), or a string that is
such a module path (a module to import, a logger's name). Ops under ``torch.ops`` are named
by their schema, not private, and are not flagged; neither is prose (docstrings, messages).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "reffsdp/core/torch_internals.py",
    "reffsdp/swap.py",
    "testing/torch_private.py",
    "testing/impls/torch_fsdp.py",
}
_PRIVATE_PATH = re.compile(r"torch(\.\w+)*\._[A-Za-z]\w*(\.\w+)*")


def _is_private(dotted: str) -> bool:
    if not dotted.startswith("torch") or dotted.startswith("torch.ops."):
        return False
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``node`` (a name or an attribute chain) as a dotted path from a torch import, if any."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def private_uses(source: str) -> list[str]:
    """The private torch names ``source`` uses, one ``line: name`` each."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    found = []
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name.startswith("torch"):
                    bound = name.asname or name.name.split(".")[0]
                    aliases[bound] = name.name if name.asname else bound
                    if _is_private(name.name):
                        found.append(f"{node.lineno}: {name.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            for name in node.names:
                full = f"{node.module}.{name.name}"
                aliases[name.asname or name.name] = full
                if _is_private(full):
                    found.append(f"{node.lineno}: {full}")
    for node in ast.walk(tree):
        # Module-level aliases such as ``_c10d = dist.distributed_c10d``.
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], _dotted(node.value, aliases)
            if isinstance(target, ast.Name) and value is not None:
                aliases.setdefault(target.id, value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node, aliases)
            if dotted is not None and _is_private(dotted):
                found.append(f"{node.lineno}: {dotted}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and _PRIVATE_PATH.fullmatch(node.value)
        ):
            found.append(f"{node.lineno}: {node.value!r}")
    # An attribute chain is reported once, at its longest (outermost) form.
    return sorted(
        {use for use in found if not any(o != use and o.startswith(use + ".") for o in found)}
    )


def _scanned_files() -> list[str]:
    files = [*ROOT.glob("testing/**/*.py"), *ROOT.glob("reffsdp/**/*.py")]
    relative = (str(path.relative_to(ROOT)) for path in files)
    return sorted(path for path in relative if path not in ALLOWED)


@pytest.mark.parametrize("path", _scanned_files())
def test_no_private_torch_name_outside_the_wrapping_modules(path: str) -> None:
    uses = private_uses((ROOT / path).read_text())
    assert not uses, (
        f"{path} uses private torch names {uses}: wrap each once in "
        "reffsdp/core/torch_internals.py (what reffsdp needs) or testing/torch_private.py "
        "(what only the harness needs), with a docstring that says why"
    )


def test_reffsdp_core_has_no_ctypes() -> None:
    users = [
        str(path.relative_to(ROOT))
        for path in ROOT.glob("reffsdp/core/*.py")
        if "ctypes" in path.read_text()
    ]
    assert not users, f"reffsdp/core reaches into the interpreter with ctypes in {users}"


def test_the_scan_sees_each_kind_of_private_use() -> None:
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.utils._pytree import tree_leaves\n"
        "from torch.utils import _python_dispatch\n"
        "_c10d = dist.distributed_c10d\n"
        "_aten = torch.ops.aten\n"
        'NAME = "torch._dynamo"\n'
        "def f():\n"
        '    """Not torch._C.fork: prose."""\n'
        "    torch._C.fork(f)\n"
        "    _c10d._world\n"
        "    dist.Backend._plugins\n"
        "    _aten._to_copy.default\n"
        "    torch.__version__\n"
    )
    assert private_uses(source) == [
        "10: torch._C.fork",
        "11: torch.distributed.distributed_c10d._world",
        "12: torch.distributed.Backend._plugins",
        "3: torch.utils._pytree.tree_leaves",
        "4: torch.utils._python_dispatch",
        "7: 'torch._dynamo'",
    ]
