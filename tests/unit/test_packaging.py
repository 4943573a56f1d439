"""The top-level ``testing/`` folder ships as ``reffsdp.testing`` in a normal (wheel) install."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_wheel_contains_the_testing_subpackage(tmp_path):
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
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("reffsdp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("__init__", "multithread", "multiprocess", "parity", "threaded_pg"):
        assert f"reffsdp/testing/{module}.py" in names
    assert "reffsdp/per_param/fully_shard.py" in names
    assert not any(name.startswith("testing/") for name in names)
    metadata = next(n for n in names if n.endswith("METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist: torch")
    ]
    assert requires == ["Requires-Dist: torch>=2.11"], requires


def test_installed_package_imports_testing():
    import reffsdp.testing

    assert Path(reffsdp.testing.__file__).parent.name == "testing"
    assert hasattr(reffsdp.testing, "FSDPTestMultiThread")
