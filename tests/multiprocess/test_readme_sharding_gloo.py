"""README's "Sharding a model" runs as its first line says: under torchrun, one gloo process
per rank."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_the_sharding_example_runs_under_torchrun(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Sharding a model", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)[0]
    command = re.fullmatch(
        r"# train\.py; run it with: (torchrun .* train\.py)", code.splitlines()[0]
    )
    assert command, code.splitlines()[0]
    (tmp_path / "train.py").write_text(code)
    torchrun, *args = shlex.split(command.group(1))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} step 2: loss " in done.stdout
