"""Fixtures and a model shared by the one-process ``fully_shard`` tests."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.testing.models import MLP

FAKE_WORLD_SIZE = 4


@pytest.fixture
def mesh():
    """Rank 1 of a fake 4-rank world: collectives move no data."""
    with fake_process_group(FAKE_WORLD_SIZE, rank=1):
        yield init_device_mesh("cpu", (FAKE_WORLD_SIZE,))


class Net(nn.Module):
    """A root with its own parameters and two blocks, as a ``fully_shard`` user builds it."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, device=device)
        self.blocks = nn.ModuleList(MLP(4, device=device) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return x
