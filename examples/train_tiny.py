"""A tiny GPT trained on a tokpack run, on CPU, deterministically: the loader's resume, proven
with a model. tests/test_train_tiny.py runs it, stops it, resumes it in a fresh process and
compares the per-step losses bit for bit.

    python examples/train_tiny.py RUN --steps 30 --save-at 11 --checkpoint ckpt   # writes ckpt-11.pt
    python examples/train_tiny.py RUN --steps 30 --resume ckpt-11.pt               # steps 12..30

Each step reads one micro-batch through torchdata's StatefulDataLoader (2 workers), attends
only within each document (the batch's `cu_seqlens`, fixed-shape with --max-documents), and
trains only where the label is a token (`labels` -100 on padding). A checkpoint holds the
model, the optimizer and `loader.state_dict()`; the losses are printed as one JSON line,
{step: float.hex(loss)}, for an exact comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from tokpack import TokpackDataset


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m, L, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(m, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # mask: True where attention is allowed
        x = x + self.out(a.transpose(1, 2).reshape(m, L, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, position_ids, cu_seqlens):
        m, L = input_ids.shape
        # The document of each token of the flattened micro-batch, from the boundaries: a token
        # attends to the earlier tokens of its own document only. (The zero-length segments
        # that pad a fixed-shape cu_seqlens hold no token, so they change nothing here.)
        doc = torch.searchsorted(cu_seqlens, torch.arange(m * L, dtype=cu_seqlens.dtype), right=True).view(m, L)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def train_step(model, optimizer, batch) -> float:
    """One step; the core a training loop over TokpackDataset needs."""
    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)  # no padding trains
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a tokpack run (best-fit or window) or epoch directory")
    p.add_argument("--steps", type=int, default=30, help="the last step to train (steps count from 1)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--workers", type=int, default=2, help="StatefulDataLoader workers")
    p.add_argument("--max-documents", type=int, default=None, help="fixed-shape boundaries (see `tokpack inspect`)")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--save-at", type=int, action="append", default=[], help="checkpoint after this step")
    p.add_argument("--checkpoint", default="ckpt", help="checkpoint path prefix: PREFIX-STEP.pt")
    p.add_argument("--resume", default=None, help="a checkpoint to continue from")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread: the same float sums in every process
    torch.use_deterministic_algorithms(True)
    ds = TokpackDataset(args.run, micro_batch=args.micro_batch, max_documents=args.max_documents)
    model = TinyGPT(args.vocab, ds.reader.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=args.workers)
    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        ds.load_loader_state(loader, ckpt["loader"])
        step = ckpt["step"]
    losses = {}
    for batch in loader:
        if step == args.steps:
            break
        step += 1
        loss = train_step(model, optimizer, batch)
        if not math.isfinite(loss):
            print(f"train_tiny: step {step}: loss {loss}", file=sys.stderr)
            return 1
        losses[step] = loss.hex()
        if step in args.save_at:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                    "step": step,
                },
                f"{args.checkpoint}-{step}.pt",
            )
    print(json.dumps(losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
