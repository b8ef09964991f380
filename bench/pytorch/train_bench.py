"""The shakespeare-char training step in PyTorch, timed like `transformer-lab bench train`.

Kept apart from the project (it is not a dependency of anything): it exists to measure PyTorch
on the same machine, in the same sitting, with the same model, optimizer and batches.

    python3 bench/pytorch/train_bench.py --data-dir DATA [--threads 2] [--steps 30] [--warmup 5] [--runs 3]
        [--adamw default|foreach|fused]

Model (experiments/shakespeare-char.json): 4 pre-norm blocks, 4 heads, d_model 128, d_ff 512,
exact GELU, no biases, learned positions, tied input/output embedding, context 64, batch 12;
AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.1 on matrices only) with global-norm clipping 1.0.
Prints tokens/s (median of the runs) and the forward / backward / optimizer split.
"""

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h, d_ff):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d, bias=False)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d, bias=False)
        self.fc = nn.Linear(d, d_ff, bias=False)
        self.out = nn.Linear(d_ff, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, d=128, h=4, layers=4, context=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, h, 4 * d) for _ in range(layers))
        self.ln = nn.LayerNorm(d, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("out.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.T
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def adamw(model, implementation="default"):
    """nanoGPT's AdamW: lr 1e-3, betas 0.9/0.99, weight decay 0.1 on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),
        **({} if implementation == "default" else {implementation: True}),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--adamw",
        choices=["default", "foreach", "fused"],
        default="default",
        help="PyTorch's AdamW implementation (default: its per-parameter loop on a CPU)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)

    text = (args.data_dir / "tinyshakespeare" / "input.txt").read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text[: int(0.9 * len(text))]])
    batch, context = 12, 64
    starts = torch.randint(len(ids) - context - 1, (args.warmup + args.steps, batch))
    batches = [
        (torch.stack([ids[s : s + context] for s in row]), torch.stack([ids[s + 1 : s + 1 + context] for s in row]))
        for row in starts
    ]

    speeds, splits = [], []
    for _ in range(args.runs):
        model = Gpt(len(chars))
        opt = adamw(model, args.adamw)
        times = []
        for step, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            loss = model(x, y)
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            t3 = time.perf_counter()
            if step >= args.warmup:
                times.append((t1 - t0, t2 - t1, t3 - t2))
        total = sum(sum(t) for t in times)
        speeds.append(len(times) * batch * context / total)
        splits.extend(times)
    fwd, bwd, opt_t = (statistics.median(t[i] for t in splits) * 1e3 for i in range(3))
    print(
        f"pytorch {torch.__version__}, {args.threads} threads, AdamW {args.adamw}: {statistics.median(speeds):.0f} tokens/s "
        f"(median of {args.runs} runs: {', '.join(f'{s:.0f}' for s in speeds)}; {batch * context} tokens per step)"
    )
    print(f"median step {fwd + bwd + opt_t:.1f} ms = forward {fwd:.1f} + backward {bwd:.1f} + optimizer {opt_t:.1f}")


if __name__ == "__main__":
    main()
