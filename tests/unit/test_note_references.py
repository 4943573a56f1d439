"""Every ``[Note: X]`` a reader is sent to exists, at module level, where the reference says.

A note is a block of explanation that starts with a line holding only ``[Note: X]`` (in a
module docstring, or as a ``# [Note: X]`` comment at the module's top level). Any other
mention of ``[Note: X]`` in the package, the testing package, the tests, README or docs is a
reference: it must name a note that exists, and where it says which module holds it
(``[Note: X] in reffsdp/core/compat.py``, ``... in ``core/compat````, ``... in
reffsdp.testing.parity``), the note must be in that module.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("reffsdp", "testing", "tests", "docs")

DEFINITION = re.compile(r"^(?P<indent>\s*)(?:#\s*)?\[Note: (?P<name>[^\]]+)\]\s*$")
REFERENCE = re.compile(r"\[Note: (?P<name>[^\]]+)\]")
# The module a reference names right after it: "in reffsdp/core/mesh.py", "in ``core/compat``",
# "in reffsdp.testing.parity", "(see ... in param_group)".
# A bare word counts only as a path or dotted name; in double backticks, any name.
IN_MODULE = re.compile(r"^\)?\s*(?:in|of)\s+(?:``(?P<quoted>[\w./]+)``|(?P<bare>\w+(?:[./]\w+)+))")


def _files() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in SOURCES:
        found += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md"))
    return [p for p in found if p.name != Path(__file__).name]


def _module_path(path: Path) -> str:
    """``testing/parity.py`` -> ``reffsdp/testing/parity``, ``reffsdp/__init__.py`` ->
    ``reffsdp``."""
    text = path.relative_to(ROOT).with_suffix("").as_posix().removesuffix("/__init__")
    return "reffsdp/" + text if text.startswith("testing/") or text == "testing" else text


def _names_module(reference: str, path: Path) -> bool:
    """Whether ``reference`` (a path or a dotted name, maybe partial) names ``path``'s module."""
    wanted = reference.removesuffix(".py").replace(".", "/").removesuffix("/__init__")
    have = _module_path(path)
    return have == wanted or have.endswith("/" + wanted)


def _collect() -> tuple[dict[str, list[tuple[Path, int, int]]], list[tuple[Path, int, str, str]]]:
    notes: dict[str, list[tuple[Path, int, int]]] = {}
    references = []
    for path in _files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            match = DEFINITION.match(line)
            if match and path.suffix == ".py":
                notes.setdefault(match["name"], []).append((path, number, len(match["indent"])))
                continue
            for ref in REFERENCE.finditer(line):
                # what follows, joined with the next line: "in <module>" may wrap
                following = lines[number].strip() if number < len(lines) else ""
                after = line[ref.end() :] + " " + following
                references.append((path, number, ref["name"], after.strip()))
    return notes, references


NOTES, REFERENCES = _collect()


def test_the_scan_finds_notes_and_references():
    assert len(NOTES) > 50 and len(REFERENCES) > 100


@pytest.mark.parametrize("name", sorted(NOTES))
def test_a_note_is_defined_once_at_module_level(name):
    places = NOTES[name]
    assert len(places) == 1, f"[Note: {name}] is defined {len(places)} times: {places}"
    path, number, indent = places[0]
    where = f"{path.relative_to(ROOT)}:{number}"
    assert indent == 0, f"[Note: {name}] at {where} is inside a class or function"


def test_every_reference_names_a_note_where_it_says():
    wrong = []
    for path, number, name, after in REFERENCES:
        where = f"{path.relative_to(ROOT)}:{number}"
        if name not in NOTES:
            wrong.append(f"{where}: [Note: {name}] names no note")
            continue
        module = IN_MODULE.match(after)
        note_path = NOTES[name][0][0]
        named = module and (module["quoted"] or module["bare"])
        if named and not _names_module(named, note_path):
            wrong.append(
                f"{where}: [Note: {name}] is said to be in {named}, but it is in "
                f"{note_path.relative_to(ROOT)}"
            )
    assert not wrong, "\n".join(wrong)
