"""README's "Counting collectives": around ``check_train_parity`` a ``CommCounter`` counts
DDP's and the checker's collectives too, while ``observe_collectives`` sees only reffsdp's.
The README's code runs here as written, on each rank of a threaded world."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from reffsdp import fully_shard
from reffsdp.testing import MLP, Collective, init_deterministic
from reffsdp.testing.multithread import run_threaded

pytestmark = pytest.mark.multithread


def _example() -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Counting collectives", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    return code


def test_the_readme_counting_example_says_what_each_counter_saw():
    code = compile(_example(), "README.md", "exec")
    seen = {}

    def on_rank(rank: int) -> None:
        model = init_deterministic(MLP(8))
        namespace = {
            "model": model,
            "ref_model": copy.deepcopy(model),
            "make_inputs": lambda iteration, rank: torch.randn(
                4, 8, generator=torch.Generator().manual_seed(10 * iteration + rank)
            ),
        }
        fully_shard(model)
        exec(code, namespace)
        seen[rank] = namespace["everything"].get_comm_counts(), namespace["ours"]

    run_threaded(on_rank, 2)
    for everything, ours in seen.values():
        assert ours[Collective.ALL_REDUCE] == 0
        assert ours[Collective.ALL_GATHER] > 0 and ours[Collective.REDUCE_SCATTER] == 2
        # DDP's gradient all-reduce and the checker's verdicts (3 per step, + 1 at the start)
        assert everything[Collective.ALL_REDUCE] >= 2 + 7
        assert everything[Collective.BROADCAST] >= 1  # DDP's, of the reference's parameters
        assert everything[Collective.ALL_GATHER] >= ours[Collective.ALL_GATHER]
