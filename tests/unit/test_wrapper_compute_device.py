"""Where the wrapper computes when ``device_id`` is not given.

A CPU module with no ``device_id`` goes to the current accelerator, as torch's wrapper
decides, unless its collectives run on gloo: then it stays on the CPU (torch's wrapper
fails there at the first forward with "unexpectedly has parameters on cpu"). Checked with
a GPU pretended on a CPU machine, so the rule holds where CI has no GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from reffsdp.testing.fake_pg import fake_process_group
from reffsdp.wrapper.setup import compute_device


@pytest.fixture
def pretend_cuda(monkeypatch):
    """``torch.accelerator`` answers as on a machine with one GPU."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)


@pytest.fixture
def gloo_world(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gloo_keeps_a_cpu_module_on_the_cpu(pretend_cuda, gloo_world):
    module = nn.Linear(2, 2)
    assert compute_device(module, None) == torch.device("cpu")
    assert compute_device(module, None, dist.group.WORLD) == torch.device("cpu")
    assert compute_device(module, None, (dist.group.WORLD, dist.group.WORLD)).type == "cpu"


def test_other_backends_and_meshes_pick_the_accelerator(pretend_cuda):
    module = nn.Linear(2, 2)
    with fake_process_group(2, rank=0):
        assert compute_device(module, None) == torch.device("cuda", 0)
        cpu_mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        assert compute_device(module, None, device_mesh=cpu_mesh) == torch.device("cpu")


def test_device_id_wins(pretend_cuda, gloo_world):
    assert compute_device(nn.Linear(2, 2), torch.device("cuda", 0)) == torch.device("cuda", 0)
