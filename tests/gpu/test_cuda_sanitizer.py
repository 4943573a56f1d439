"""torch's CUDA stream sanitizer finds no race in training with either API.

Each configuration of ``sanitized_training.py`` runs in a process of its own with
``TORCH_CUDA_SANITIZER=1`` (the sanitizer hooks CUDA when torch first initialises it). The
sanitizer tracks, per kernel, which stream read or wrote which memory and which events and
stream waits order the streams; an access from one stream to memory another stream may
still be using raises with both stacks. A clean run is the GPU's word on the stream rules in
``reffsdp/core/streams.py``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from .sanitized_training import CONFIGS, PLANTS

pytestmark = pytest.mark.gpu

SCRIPT = pathlib.Path(__file__).with_name("sanitized_training.py")
ROOT = SCRIPT.parents[2]


def sanitized(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_no_race_under_torch_cuda_sanitizer(config: str) -> None:
    done = sanitized(config)
    output = done.stdout + done.stderr
    assert "CSAN detected a possible data race" not in output, output
    assert done.returncode == 0, output
    assert f"{config}: losses" in done.stdout, output


@pytest.mark.parametrize("rule", sorted(PLANTS))
def test_sanitizer_reports_a_broken_stream_rule(rule: str) -> None:
    """The check above can fail: with one rule of streams.py undone, the sanitizer objects."""
    done = sanitized("fully_shard", rule)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "CSAN detected a possible data race" in output, output
