"""README's "Checking your own model" examples for a Hugging Face model run as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach a hub

import pytest  # noqa: E402

pytest.importorskip("transformers")

pytest_plugins = ["reffsdp.testing.pytest_plugin"]
pytestmark = pytest.mark.multithread


def _readme_namespace() -> dict:
    """README's examples of the section, run in order in one namespace, as a reader would."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Checking your own model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 3, "the tiny model, GPT-2's scenarios, GPT-2 sharded by hand"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    return namespace


def test_gpt2_scenarios_pass():
    namespace = _readme_namespace()
    scenarios = {scenario.name: scenario for scenario in namespace["GPT2_SCENARIOS"]}
    assert len(scenarios) == 24
    for name in ("fully_shard/hsdp/accum/custom", "wrapper/1d/sd-sharded/custom"):
        result = scenarios[name].run_threaded()
        assert result.status == "passed", (name, result.message)


def test_gpt2_sharded_by_hand(thread_world):
    _readme_namespace()["test_gpt2_sharded_by_hand"](thread_world)
