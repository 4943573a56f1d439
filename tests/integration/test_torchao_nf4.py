"""A real tensor subclass with FSDP's all-gather extension: torchao's NF4 tensor, as in QLoRA.

torchao's ``NF4Tensor`` keeps a weight in 4 bits (packed codes, per-block int8 scalers and
their float32 factors) and defines ``fsdp_pre_all_gather``/``fsdp_post_all_gather``, so
``fully_shard`` gathers those inner tensors instead of a float weight. The model here is
QLoRA-shaped: each linear layer has a frozen NF4 base weight plus trainable low-rank
adapters. It trains for a few steps on 2 threaded ranks under reffsdp's ``fully_shard`` and
under torch's, built from the same numbers, and the two must agree on

* the loss of every step and the trainable (adapter) parameters after training, and
* the collectives of every step, by kind, byte size and order: above all the all-gathers of
  the NF4 groups, whose bytes are the NF4 tensors' inner bytes, not a float weight's.

Skipped unless the installed torchao is the ``lowbit`` extra's pin (``pip install
'reffsdp[lowbit]'``) and the installed torch is one it pairs with.
"""

from __future__ import annotations

import math

import pytest

torchao = pytest.importorskip("torchao", reason="needs torchao: pip install 'reffsdp[lowbit]'")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from reffsdp import fully_shard  # noqa: E402
from reffsdp.core.comms import Collective  # noqa: E402
from reffsdp.core.compat import TORCH_VERSION  # noqa: E402
from reffsdp.testing.comm_counter import CommCounter, all_gather_numel  # noqa: E402
from reffsdp.testing.multithread import FSDPTestMultiThread  # noqa: E402

# The lowbit extra's pin in pyproject.toml. From 0.17 on, torchao builds against torch's
# stable ABI and pairs with every torch from 2.11 on (its compatibility table ends there);
# 0.18.0 was checked here with torch 2.11.0, 2.13.0 and 2.15.0 on CPU.
TORCHAO_PIN = "0.18.0"
TORCH_MIN = (2, 11)

if torchao.__version__.split("+")[0] != TORCHAO_PIN:
    pytest.skip(
        f"torchao {torchao.__version__} is installed; these tests are for torchao {TORCHAO_PIN}"
        " (pip install 'reffsdp[lowbit]')",
        allow_module_level=True,
    )
if TORCH_VERSION < TORCH_MIN:
    pytest.skip(
        f"torchao {TORCHAO_PIN} pairs with torch 2.11 and later, not {torch.__version__}",
        allow_module_level=True,
    )

from torchao.quantization import NF4Tensor, to_nf4  # noqa: E402  (torchao.dtypes before 0.18)

pytestmark = pytest.mark.multithread

AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
WORLD_SIZE = 2
DIM, HIDDEN, OUT, LORA_RANK = 128, 256, 256, 8
NUM_STEPS = 3
# torch's fully_shard shards an NF4 weight on dim 0 by splitting each inner tensor evenly;
# with to_nf4's default blocks (64 values per scaler, 256 scalers per factor) every shard of
# these weights holds whole blocks, as QLoRA's real weights do.
BLOCK_SIZE, SCALER_BLOCK_SIZE = 64, 256
NF4_INNER = ("quantized_data", "quantized_scalers", "quantization_factor")


def nf4_nbytes(weight: NF4Tensor) -> int:
    """Bytes of an NF4 tensor's inner tensors: what an all-gather of the whole tensor moves."""
    return sum(getattr(weight, name).nbytes for name in NF4_INNER)


class FrozenNF4Linear(nn.Module):
    """A linear layer whose frozen weight is stored in NF4 (no bias).

    A module of its own, so ``fully_shard`` puts the NF4 weight in a group alone and that
    group's all-gather carries NF4 bytes only.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        nf4 = to_nf4(weight, BLOCK_SIZE, SCALER_BLOCK_SIZE)
        self.weight = nn.Parameter(nf4, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # NF4Tensor dequantizes it, forward and backward


class QLoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))``: a frozen NF4 base and trainable float32 adapters."""

    def __init__(self, in_dim: int, out_dim: int, generator: torch.Generator) -> None:
        super().__init__()
        base = torch.randn(out_dim, in_dim, generator=generator) / math.sqrt(in_dim)
        self.base = FrozenNF4Linear(base)
        a = torch.randn(LORA_RANK, in_dim, generator=generator) / math.sqrt(in_dim)
        # QLoRA starts B at zero; small values instead, so both adapters move from step 1.
        b = torch.randn(out_dim, LORA_RANK, generator=generator) * 0.01
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(b)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


class TinyQLoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1234)  # the same model on every rank
        self.up = QLoRALinear(DIM, HIDDEN, generator)
        self.down = QLoRALinear(HIDDEN, OUT, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))

    def layers(self) -> list[QLoRALinear]:
        return [self.up, self.down]


def shard(shard_fn, model: TinyQLoRA, mesh, reshard_after_forward: bool) -> None:
    """Each NF4 base in a group of its own; the root's group holds every adapter."""
    for layer in model.layers():
        shard_fn(layer.base, mesh=mesh, reshard_after_forward=reshard_after_forward)
    shard_fn(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def train(model: TinyQLoRA, rank: int) -> tuple[list[torch.Tensor], list[list], list[list]]:
    """Losses, and each step's forward and backward ``(kind, nbytes)`` collective sequences."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-2)
    generator = torch.Generator().manual_seed(rank)  # each rank its own batch, every step
    x = torch.randn(4, DIM, generator=generator)
    target = torch.randn(4, OUT, generator=generator)
    losses, forward_comms, backward_comms = [], [], []
    for _ in range(NUM_STEPS):
        with CommCounter() as forward:
            loss = F.mse_loss(model(x), target)
        with CommCounter() as backward:
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
        forward_comms.append(forward.get_comm_sequence())
        backward_comms.append(backward.get_comm_sequence())
    return losses, forward_comms, backward_comms


class TestNF4QLoRA(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return WORLD_SIZE

    def _expected_nf4_all_gather_bytes(self) -> list[int]:
        """Per NF4 group, the bytes of its all-gather: the whole NF4 tensor's inner bytes."""
        return [nf4_nbytes(layer.base.weight) for layer in TinyQLoRA().layers()]

    def _adapter_all_gather_bytes(self) -> int:
        shapes = [p.shape for p in TinyQLoRA().parameters() if p.requires_grad]
        return all_gather_numel(shapes, self.world_size) * 4  # float32

    def _torch_run(self, reshard_after_forward: bool):
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = TinyQLoRA()
        shard(torch_fully_shard, model, mesh, reshard_after_forward)
        return model, train(model, self.rank)

    def test_torch_fully_shard_gathers_nf4_bytes(self):
        """The reference itself, as measured: what the comparison below holds reffsdp to."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._check_torch)

    def _check_torch(self, reshard_after_forward: bool):
        model, (losses, forward_comms, backward_comms) = self._torch_run(reshard_after_forward)
        for layer in model.layers():
            weight = layer.base.weight
            self.assertIsInstance(weight, DTensor)
            self.assertIsInstance(weight.to_local(), NF4Tensor)
            self.assertFalse(weight.requires_grad)
        nf4_bytes = self._expected_nf4_all_gather_bytes()
        adapter_bytes = self._adapter_all_gather_bytes()
        # 4-bit codes plus block scalers: well under a quarter of a float32 weight.
        for nbytes, layer in zip(nf4_bytes, TinyQLoRA().layers()):
            float32_bytes = layer.base.weight.numel() * 4
            self.assertLess(nbytes, float32_bytes / 4)
        # Forward: the root (every adapter) first, then each NF4 base in the order it runs.
        up, down = nf4_bytes
        expected_forward = [(AG, adapter_bytes), (AG, up), (AG, down)]
        self.assertEqual(forward_comms, [expected_forward] * NUM_STEPS)
        # Backward: resharded groups are gathered again, in reverse order; the frozen NF4
        # weights have no gradient to reduce-scatter, the adapters one.
        if reshard_after_forward:
            expected_backward = [(AG, adapter_bytes), (AG, down), (AG, up), (RS, adapter_bytes)]
        else:
            expected_backward = [(RS, adapter_bytes)]
        self.assertEqual(backward_comms, [expected_backward] * NUM_STEPS)
        self.assertTrue(all(torch.isfinite(loss) for loss in losses))
        self.assertLess(losses[-1].item(), losses[0].item())

    def test_training_matches_torch(self):
        self.run_subtests({"reshard_after_forward": [True, False]}, self._check_against_torch)

    def _check_against_torch(self, reshard_after_forward: bool):
        ref_model, (ref_losses, ref_forward, ref_backward) = self._torch_run(reshard_after_forward)
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = TinyQLoRA()
        shard(fully_shard, model, mesh, reshard_after_forward)
        losses, forward_comms, backward_comms = train(model, self.rank)
        for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
            torch.testing.assert_close(loss, ref_loss, msg=f"loss of step {step}")
        self.assertEqual(forward_comms, ref_forward)
        self.assertEqual(backward_comms, ref_backward)
        named = dict(model.named_parameters())
        for name, ref_param in ref_model.named_parameters():
            if not ref_param.requires_grad:
                continue
            param = named[name]
            self.assertIsInstance(param, DTensor, msg=name)
            torch.testing.assert_close(param.to_local(), ref_param.to_local(), msg=name)
            torch.testing.assert_close(param.full_tensor(), ref_param.full_tensor(), msg=name)
        for layer in model.layers():
            self.assertFalse(layer.base.weight.requires_grad)
