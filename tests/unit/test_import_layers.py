"""The modules of reffsdp and ``reffsdp.testing`` import one another one way only: no
circle, counting imports made inside functions (a function-local import hides a circle from
the interpreter, not from a reader) and imports made for type checking alone (a reader
follows those too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "reffsdp": ROOT / "reffsdp",
    "reffsdp.core": ROOT / "reffsdp" / "core",
    "reffsdp.per_param": ROOT / "reffsdp" / "per_param",
    "reffsdp.algorithms": ROOT / "reffsdp" / "algorithms",
    "reffsdp.testing": ROOT / "testing",
    "reffsdp.bench": ROOT / "reffsdp" / "bench",
    "reffsdp.wrapper": ROOT / "reffsdp" / "wrapper",
}
# The wrapper's helpers take an instance's state (wrapper/state.py), never the nn.Module.
WRAPPER_HELPERS = (
    "full_params",
    "state_dict",
    "optim_state",
    "optim_state_load",
    "legacy_optim_state",
)


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` imports, anywhere in its source."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # "from package import submodule" imports the submodule, not the package.
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                for alias in node.names
            ]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, as the path around it, or ``None``."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            circle = visit(imported, [*path, module])
            if circle:
                return circle
        done.add(module)
        return None

    for module in sorted(graph):
        circle = visit(module, [])
        if circle:
            return circle
    return None


def test_no_import_circles_anywhere():
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    # The circles there were, and the module each now goes through instead.
    assert "reffsdp.bench.cli" not in graph["reffsdp.bench.scaling"]
    assert "reffsdp.testing.parity_suite" not in graph["reffsdp.testing.self_test"]
    for helper in WRAPPER_HELPERS:
        imported = graph[f"reffsdp.wrapper.{helper}"]
        assert "reffsdp.wrapper.fully_sharded_data_parallel" not in imported, helper
    assert "reffsdp.per_param.finalization" not in graph["reffsdp.per_param.state"]
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])


@pytest.mark.parametrize(
    "graph, circle",
    [
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_the_circle_finder_finds_circles(graph, circle):
    assert _circle(graph) == circle
