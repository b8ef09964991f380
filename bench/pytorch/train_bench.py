"""The shakespeare-char training step in PyTorch, timed like `transformer-lab bench train`.

Kept apart from the project (it is not a dependency of anything): it exists to measure PyTorch
on the same machine, in the same sitting, with the same model, optimizer and batches.

    python3 bench/pytorch/train_bench.py --data-dir DATA [--threads 2] [--steps 30] [--warmup 5] [--runs 3]
        [--adamw default|foreach|fused] [--config small|gpu] [--device cpu|cuda]
        [--dtype f32|tf32|bf16|f16] [--compile]

Model (`--config small`, experiments/shakespeare-char.json): 4 pre-norm blocks, 4 heads,
d_model 128, d_ff 512, exact GELU, no biases, learned positions, tied input/output embedding,
context 64, batch 12, no dropout. `--config gpu` (experiments/shakespeare-char-gpu.json, nanoGPT's
shakespeare-char): 6 blocks, 6 heads, d_model 384, d_ff 1536, context 256, batch 64, dropout 0.2
(embeddings, attention weights, residual branches). AdamW (lr 1e-3, betas 0.9/0.99, weight decay
0.1 on matrices only) with global-norm clipping 1.0.

`--dtype tf32` keeps f32 weights and activations but lets CUDA's products round their inputs to
TF32 on tensor cores (10-bit mantissas): nanoGPT's setting, and what burn's autotuned matmul may
pick for f32 on cuda (cubek's accelerated kernels stage f32 as TF32). `--dtype bf16|f16` trains
under torch.autocast (products in half precision, f32 weights; f16 with a GradScaler), what
`transformer-lab train --precision` does; `--compile` runs torch.compile'd (nanoGPT's default on
a GPU). Prints tokens/s (median of the runs) and the forward / backward /
optimizer split.
"""

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


CONFIGS = {
    # d_model, heads, layers, context, batch, dropout
    "small": dict(d=128, h=4, layers=4, context=64, batch=12, dropout=0.0),
    "gpu": dict(d=384, h=6, layers=6, context=256, batch=64, dropout=0.2),
}


class Block(nn.Module):
    def __init__(self, d, h, d_ff, dropout=0.0):
        super().__init__()
        self.h = h
        self.p = dropout
        self.drop = nn.Dropout(dropout)
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
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Gpt(nn.Module):
    def __init__(self, vocab, d=128, h=4, layers=4, context=64, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, h, 4 * d, dropout) for _ in range(layers))
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
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
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
    ap.add_argument("--config", choices=sorted(CONFIGS), default="small")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", choices=["f32", "tf32", "bf16", "f16"], default="f32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    device = torch.device(args.device)
    shape = CONFIGS[args.config]
    half = {"f32": None, "tf32": None, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    # PyTorch's default for f32 products is full f32; tf32 is the setting nanoGPT trains with.
    # The other dtypes keep PyTorch's defaults untouched.
    if args.dtype == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    text = (args.data_dir / "tinyshakespeare" / "input.txt").read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text[: int(0.9 * len(text))]])
    batch, context = shape["batch"], shape["context"]
    starts = torch.randint(len(ids) - context - 1, (args.warmup + args.steps, batch))
    batches = [
        (
            torch.stack([ids[s : s + context] for s in row]).to(device),
            torch.stack([ids[s + 1 : s + 1 + context] for s in row]).to(device),
        )
        for row in starts
    ]

    speeds, splits = [], []
    for _ in range(args.runs):
        model = Gpt(
            len(chars), shape["d"], shape["h"], shape["layers"], context, shape["dropout"]
        ).to(device)
        opt = adamw(model, args.adamw)
        step_model = torch.compile(model) if args.compile else model
        scaler = torch.amp.GradScaler(device.type, enabled=half == torch.float16)
        times = []
        for step, (x, y) in enumerate(batches):
            sync()
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
                loss = step_model(x, y)
            sync()
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            sync()
            t2 = time.perf_counter()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sync()
            t3 = time.perf_counter()
            if step >= args.warmup:
                times.append((t1 - t0, t2 - t1, t3 - t2))
        total = sum(sum(t) for t in times)
        speeds.append(len(times) * batch * context / total)
        splits.extend(times)
    fwd, bwd, opt_t = (statistics.median(t[i] for t in splits) * 1e3 for i in range(3))
    where = f"{args.threads} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    how = f"{args.config}, {args.dtype}{', compiled' if args.compile else ''}, AdamW {args.adamw}"
    print(
        f"pytorch {torch.__version__}, {where}, {how}: {statistics.median(speeds):.0f} tokens/s "
        f"(median of {args.runs} runs: {', '.join(f'{s:.0f}' for s in speeds)}; {batch * context} tokens per step)"
    )
    print(f"median step {fwd + bwd + opt_t:.1f} ms = forward {fwd:.1f} + backward {bwd:.1f} + optimizer {opt_t:.1f}")


if __name__ == "__main__":
    main()
