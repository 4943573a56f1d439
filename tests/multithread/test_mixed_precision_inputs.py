"""Both APIs cast forward inputs by one rule under mixed precision: floating-point tensors
to ``param_dtype``, wherever they sit (tuples, dicts, dataclass fields), and nothing else.

torch's wrapper casts a dataclass's fields too; reffsdp's wrapper used to leave them in
float32 while ``fully_shard`` cast them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

from reffsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard
from reffsdp.testing.multithread import FSDPTestMultiThread

pytestmark = pytest.mark.multithread

BF16 = torch.bfloat16


@dataclasses.dataclass
class Batch:
    features: torch.Tensor  # floating: cast
    ids: torch.Tensor  # integer: kept


class Recorder(nn.Module):
    """Records the dtypes its inputs arrive in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, batch: Batch, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        self.seen.append((batch.features.dtype, batch.ids.dtype, extra["x"].dtype))
        return self.lin(batch.features).sum() + extra["x"].sum()


def _inputs() -> tuple[Batch, dict[str, torch.Tensor]]:
    return Batch(torch.ones(2, 4), torch.arange(2)), {"x": torch.ones(3)}


class TestForwardInputCasting(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_dataclass_fields_are_cast_alike_by_both_apis_and_torchs_wrapper(self):
        cpu = torch.device("cpu")
        built = {
            "reffsdp wrapper": FullyShardedDataParallel(
                Recorder(), mixed_precision=MixedPrecision(param_dtype=BF16)
            ),
            "torch wrapper": TorchFSDP(
                Recorder(), mixed_precision=TorchMixedPrecision(param_dtype=BF16), device_id=cpu
            ),
            "reffsdp fully_shard": fully_shard(
                Recorder(),
                mesh=init_device_mesh("cpu", (self.world_size,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=BF16),
            ),
        }
        for name, model in built.items():
            model(*_inputs())
            recorder = (
                model.module if isinstance(model, (TorchFSDP, FullyShardedDataParallel)) else model
            )
            self.assertEqual(recorder.seen, [(BF16, torch.int64, BF16)], name)
