"""Train a small Transformer with ``fully_shard`` on CPU.

Run it with::

    torchrun --nproc-per-node 2 -m reffsdp.testing.train_transformer

Each rank sees different sequences of the pattern ``start, start + 1, start + 2, ...``
(mod the vocabulary), so next-token prediction is learnable and the loss drops fast.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reffsdp import fully_shard

from .models import ModelArgs, Transformer


def batch(step: int, rank: int, *, batch_size: int, seq_len: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, vocab, (batch_size, 1), generator=generator)
    return (starts + torch.arange(seq_len)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank
    model_args = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=16, dim=64, n_heads=4)
    model = Transformer(model_args)
    for block in model.layers:
        fully_shard(block)  # one all-gather / reduce-scatter unit per block
    fully_shard(model)  # the root: embeddings, norm and output layer
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step in range(args.steps):
        tokens = batch(step, rank, batch_size=8, seq_len=16, vocab=model_args.vocab_size)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
