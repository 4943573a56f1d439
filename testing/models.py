"""Small standard models that the tests shard, train and compare against a reference.

Each model is chosen for what it exercises, not for what it computes:

* :class:`MLP` and :class:`MLPStack`: plain linear layers whose widths (``3 * dim``) often do
  not divide the world size, so sharding needs padding; an optional buffer.
* :class:`DoubleLinear`: a forward that returns two outputs, or leaves a layer unused, so
  parameters without gradients show up.
* :class:`Transformer`: embeddings, attention, norms, an optionally tied output layer and
  optional activation checkpointing: the shape of real workloads, at toy size.
* :class:`ConvNet`: 4D conv weights, so sharding along dim 0 is not only about matrices.

Every model is deterministic given the global seed, keeps dropout off unless asked, and runs
on CPU in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """``in_proj -> relu -> out_proj -> relu``, plus an optional buffer added to the output.

    ``in_proj`` widens ``dim`` to ``dim_multiplier * dim``; with the multiplier 3 used by
    :class:`MLPStack`, a ``dim`` of 5 gives 15 rows, which no even world size divides.
    """

    def __init__(
        self,
        dim: int,
        device: torch.device | str | None = None,
        *,
        bias: bool = True,
        with_buffer: bool = False,
        dim_multiplier: int = 4,
    ) -> None:
        super().__init__()
        hidden = dim_multiplier * dim
        self.in_proj = nn.Linear(dim, hidden, bias=bias, device=device)
        self.out_proj = nn.Linear(hidden, dim, bias=bias, device=device)
        self.buffer: torch.Tensor | None
        if with_buffer:
            self.register_buffer("buffer", torch.empty(dim, device=device))
            self.reset_parameters()
        else:
            self.buffer = None

    def reset_parameters(self) -> None:
        """Re-initialize the buffer (the linear layers reset themselves).

        Needed after materializing a model built on the meta device: ``to_empty`` leaves
        buffers holding garbage, and only the owning module knows their initial values.
        """
        if self.buffer is not None:
            torch.nn.init.normal_(self.buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.in_proj(x))
        z = F.relu(self.out_proj(z))
        if self.buffer is not None:
            z = z + self.buffer
        return z


class MLPStack(nn.Sequential):
    """Three :class:`MLP` blocks of uneven widths (``3d``, ``4d``, ``3d`` hidden).

    With ``with_seq_parallel`` a bias-free ``LayerNorm`` follows at index 3: a sequence
    parallel plan shards the norm's input along the sequence, and a weight alone is enough
    to check that its gradient is reduced across the tensor-parallel ranks.
    """

    def __init__(self, mlp_dim: int, *, with_seq_parallel: bool = False) -> None:
        modules: list[nn.Module] = [
            MLP(mlp_dim, dim_multiplier=3),
            MLP(mlp_dim),
            MLP(mlp_dim, dim_multiplier=3),
        ]
        if with_seq_parallel:
            modules.append(nn.LayerNorm(mlp_dim, bias=False))
        super().__init__(*modules)
        self.with_seq_parallel = with_seq_parallel

    def __getitem__(self, index: int | slice) -> nn.Module:
        # nn.Sequential rebuilds a slice with ``type(self)(OrderedDict)``, which this
        # constructor does not take; a slice of the stack is a plain nn.Sequential.
        if isinstance(index, slice):
            return nn.Sequential(*list(self)[index])
        return super().__getitem__(index)


class MLPBlocks(nn.Module):
    """``proj`` (parameters of the root's own), then one :class:`MLP` block per multiplier.

    The usual shape of an FSDP test: shard each of ``layers`` and then the whole model, and
    the root's group holds ``proj``. Distinct ``dim_multipliers`` give every block's group a
    distinct size.
    """

    def __init__(
        self, dim: int, dim_multipliers: Sequence[int] = (3, 4), *, with_buffer: bool = False
    ) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(
            MLP(dim, dim_multiplier=m, with_buffer=with_buffer) for m in dim_multipliers
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return x


class DoubleLinear(nn.Module):
    """Two linear layers side by side: both used (two outputs) or ``lin2`` left unused.

    The unused case is how tests meet a parameter whose gradient stays ``None`` after
    backward.
    """

    def __init__(self, dim: int, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        if self.use_second_linear:
            return F.relu(self.lin1(x)), F.relu(self.lin2(x))
        return F.relu(self.lin1(x))


@dataclass
class ModelArgs:
    """Sizes and switches of :class:`Transformer`.

    ``dropout_p`` defaults to 0 so that two copies of the model compute the same thing on
    different ranks (dropout masks come from each rank's RNG); ``weight_tying`` shares
    ``output.weight`` with ``tok_embeddings.weight``.
    """

    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.0
    use_attn_mask: bool = True
    weight_tying: bool = False
    checkpoint_activations: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")


class Attention(nn.Module):
    """Multi-head self-attention; causal when ``args.use_attn_mask``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.is_causal = args.use_attn_mask
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.resid_dropout = nn.Dropout(args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            # (batch, seq, dim) -> (batch, heads, seq, dim / heads)
            return t.view(batch, seq, self.n_heads, dim // self.n_heads).transpose(1, 2)

        q, k, v = split_heads(self.wq(x)), split_heads(self.wk(x)), split_heads(self.wv(x))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=self.is_causal
        )
        out = out.transpose(1, 2).reshape(batch, seq, dim)
        return self.resid_dropout(self.wo(out))


class FeedForward(nn.Module):
    """``w1 -> gelu -> w2`` with a 4x hidden width."""

    def __init__(self, dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A decoder-only transformer over token ids of shape ``(batch, seq)``.

    Returns float32 logits of shape ``(batch, seq, vocab_size)`` whatever the compute dtype,
    so losses of mixed-precision and full-precision runs compare in one dtype.

    With ``weight_tying`` the output layer reuses the embedding table: one parameter,
    reachable under two names (``named_parameters`` reports it once, as
    ``tok_embeddings.weight``). With ``checkpoint_activations`` each block's activations are
    dropped after forward and recomputed in backward (non-reentrant checkpointing).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.args.max_seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for layer in self.layers:
            if self.args.checkpoint_activations:
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h)).float()


class ConvNet(nn.Module):
    """Two 3x3 convolutions, global average pooling and a linear head; no BatchNorm.

    BatchNorm is left out on purpose: its running statistics are per-rank buffers that a
    data-parallel reference would have to synchronize, which is not what these tests check.
    Any image of at least 1x1 pixels works, since pooling removes the spatial size.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, kernel_size=3, padding=1, stride=2)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv1(images))
        h = F.relu(self.conv2(h))
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.head(h)


def init_deterministic(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give ``module`` the same parameters on every rank, without collectives, and keep its
    ReLUs alive.

    Every parameter gets ``0.5 * N(0, 1) + 0.1`` from a generator seeded with ``seed``. The
    positive shift matters for tests that must be able to fail: with default initialization
    a small ReLU network can come out with every output dead, all gradients zero, and any
    gradient bug invisible.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + 0.1)
    return module


class CheckpointedMLPStack(MLPStack):
    """:class:`MLPStack` whose blocks recompute their activations in backward
    (non-reentrant activation checkpointing around each block's call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = checkpoint(block, x, use_reentrant=False)
        return x


class TiedMLPStack(nn.Module):
    """``proj``, an :class:`MLPStack` (``blocks``), and ``head``, which shares ``proj``'s
    weight: tied weights that need no embedding, so tensor parallelism can shard the blocks
    while the tied pair stays whole (``named_parameters`` reports it as ``proj.weight``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.blocks = MLPStack(dim)
        self.head = nn.Linear(dim, dim, bias=False)
        self.head.weight = self.proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.proj(x)))


class SmoothMLP(MLP):
    """:class:`MLP` with GELU instead of ReLU: no activation switches on or off when a
    low-precision rounding moves a pre-activation across zero, so two computations that
    round differently (tensor-parallel partial sums against a whole matmul) stay close."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.gelu(self.in_proj(x))
        z = F.gelu(self.out_proj(z))
        if self.buffer is not None:
            z = z + self.buffer
        return z


class SmoothMLPStack(nn.Sequential):
    """:class:`MLPStack`'s three blocks (``3d``, ``4d``, ``3d`` hidden) as :class:`SmoothMLP`."""

    def __init__(self, mlp_dim: int) -> None:
        super().__init__(
            SmoothMLP(mlp_dim, dim_multiplier=3),
            SmoothMLP(mlp_dim),
            SmoothMLP(mlp_dim, dim_multiplier=3),
        )
