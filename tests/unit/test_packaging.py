"""The top-level ``testing/`` folder ships as ``reffsdp.testing`` in a normal (wheel) install."""

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from reffsdp.core import compat

ROOT = Path(__file__).resolve().parents[2]


def _modules(package_root: Path) -> list[Path]:
    """Every ``.py`` file of the package and of its subpackages (folders with ``__init__.py``)."""
    return [
        path
        for path in package_root.rglob("*.py")
        if (path.parent / "__init__.py").exists() and "__pycache__" not in path.parts
    ]


@pytest.mark.timeout(400)
def test_wheel_contains_the_testing_subpackage(tmp_path):
    # Build from a copy: setuptools reuses a ``build/`` folder, whose stale files could hide
    # a module missing from pyproject's package list.
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("reffsdp", "testing"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("reffsdp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        f"reffsdp/{path.relative_to(ROOT / 'reffsdp')}" for path in _modules(ROOT / "reffsdp")
    }
    sources |= {
        f"reffsdp/testing/{path.relative_to(ROOT / 'testing')}"
        for path in _modules(ROOT / "testing")
    }
    assert sources - names == set(), "modules missing from the wheel (pyproject's packages list)"
    assert not any(name.startswith("testing/") for name in names)
    metadata = next(n for n in names if n.endswith("METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if re.match(r"Requires-Dist: torch\s*[<>=!~]", line)  # torch itself, not torchao
    ]
    # The supported range, as compat states it: the oldest release up to the newest tested.
    (declared,) = requires
    oldest, newest = compat.OLDEST_SUPPORTED, compat.NEWEST_TESTED
    expected = {f">={oldest[0]}.{oldest[1]}", f"<{newest[0]}.{newest[1] + 1}"}
    assert set(declared.removeprefix("Requires-Dist: torch").split(",")) == expected, declared
    _run_one_scenario_installed(wheel, tmp_path)


def _run_one_scenario_installed(wheel: Path, tmp_path: Path) -> None:
    """Installed from the wheel (``site-packages/reffsdp/testing/``, not the checkout's
    ``testing/``), the parity suite's pytest session finds its tests and writes its JUnit."""
    target = tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
    subprocess.run([*pip, str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import reffsdp.testing.parity_tests as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=True,
    ).stdout.strip()
    if not where.startswith(str(target)):  # an editable install's finder comes first
        pytest.skip(f"the checkout's package is imported ahead of the wheel's: {where}")
    report = tmp_path / "parity.xml"
    done = subprocess.run(
        [sys.executable, "-m", "reffsdp.testing", "--only", "naive/1d/fp32/mlp", "--steps", "1"]
        + ["--junit-xml", str(report)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[1/1] PASS naive/1d/fp32/mlp" in done.stdout
    case = ET.parse(report).getroot().find("testsuite/testcase")
    assert (case.get("classname"), case.get("name")) == ("parity.naive.1d", "naive/1d/fp32/mlp")


def test_installed_package_imports_testing():
    import reffsdp.testing

    assert Path(reffsdp.testing.__file__).parent.name == "testing"
    assert hasattr(reffsdp.testing, "FSDPTestMultiThread")


# How each package of the ``test`` extra is used, and where that shows.
_TEST_EXTRA_USES = {
    "pytest-timeout": ("tests", "pytest.mark.timeout("),
    "coverage": ("tox.ini", "python -m coverage run"),
    "setuptools": ("tests/unit/test_packaging.py", '"--no-build-isolation"'),  # builds with it
    "parameterized": ("tests", "@parameterized.expand("),
}


def test_every_package_of_the_test_extra_is_used():
    """A package declared for the tests is one the tests use: none is installed for nothing."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [
        requirement.split(">")[0].split("=")[0].split("<")[0].strip()
        for requirement in extras["optional-dependencies"]["test"]
    ]
    assert sorted(declared) == sorted(_TEST_EXTRA_USES), "say how each new one is used"
    for name, (where, use) in _TEST_EXTRA_USES.items():
        path = ROOT / where
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        assert any(use in file.read_text() for file in files), (name, where, use)
