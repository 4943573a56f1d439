"""The models the benchmark trains, by name and size, and what each step feeds them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from reffsdp.testing.models import MLP, ModelArgs, Transformer, TransformerBlock

# name -> (dim, n_layers, vocab_size, seq_len, n_heads): 0.13M, 3.4M, 27.3M, 97.7M, 218M
TRANSFORMER_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 2, 256, 32, 4),
    "small": (256, 4, 512, 64, 8),
    "27m": (512, 8, 2048, 64, 8),
    "100m": (768, 12, 8192, 128, 12),
    "220m": (1024, 16, 8192, 128, 16),
}
# name -> (dim, n_layers): 0.07M, 2.2M, 26.2M, 101M, 218M
MLP_SIZES: dict[str, tuple[int, int]] = {
    "tiny": (64, 2),
    "small": (256, 4),
    "27m": (1024, 3),
    "100m": (2048, 3),
    "220m": (2048, 6),
}
SIZES = tuple(TRANSFORMER_SIZES)
# name -> (sequences, tokens per sequence) per rank and step: small enough that a step of
# the larger sizes takes seconds, not minutes, on a few CPU cores.
TRANSFORMER_BATCH: dict[str, tuple[int, int]] = {
    "tiny": (8, 32),
    "small": (8, 64),
    "27m": (4, 32),
    "100m": (2, 32),
    "220m": (2, 32),
}
MLP_BATCH = 64


class MLPModel(nn.Module):
    """``proj`` (the root's own parameters), then ``n_layers`` :class:`MLP` blocks."""

    def __init__(self, dim: int, n_layers: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(MLP(dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass(frozen=True)
class Workload:
    """A model family at one size: how to build it, feed it and score it."""

    kind: str  # "mlp" or "transformer"
    size: str

    def build(self, device: torch.device) -> nn.Module:
        """The model, with the same initial weights on every rank."""
        torch.manual_seed(0)
        if self.kind == "transformer":
            dim, n_layers, vocab, seq, heads = TRANSFORMER_SIZES[self.size]
            args = ModelArgs(
                n_layers=n_layers, vocab_size=vocab, max_seq_len=seq, dim=dim, n_heads=heads
            )
            model: nn.Module = Transformer(args)
        else:
            dim, n_layers = MLP_SIZES[self.size]
            model = MLPModel(dim, n_layers)
        return model.to(device)

    @property
    def block_class(self) -> type[nn.Module]:
        """The class of the blocks that get their own FSDP unit."""
        return TransformerBlock if self.kind == "transformer" else MLP

    def batch(self, rank: int, device: torch.device) -> torch.Tensor:
        """This rank's fixed input batch."""
        generator = torch.Generator().manual_seed(rank)
        if self.kind == "transformer":
            vocab = TRANSFORMER_SIZES[self.size][2]
            sequences, seq = TRANSFORMER_BATCH[self.size]
            tokens = torch.randint(0, vocab, (sequences, seq + 1), generator=generator)
            return tokens.to(device)
        dim, _ = MLP_SIZES[self.size]
        return torch.randn(MLP_BATCH, dim, generator=generator).to(device)

    def loss_fn(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        if self.kind == "transformer":

            def transformer_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
                logits = model(tokens[:, :-1])
                return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

            return transformer_loss

        def mlp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return model(x).float().square().mean()

        return mlp_loss


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that get their own FSDP unit (the root holds what remains)."""
    return list(model.layers)


def param_counts(model: nn.Module) -> tuple[int, int, int]:
    """``(total, root's own, largest block)`` numbers of parameters."""
    total = sum(p.numel() for p in model.parameters())
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks(model)]
    return total, total - sum(per_block), max(per_block, default=0)
