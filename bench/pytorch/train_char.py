"""Train the shakespeare-char model in PyTorch (nanoGPT's recipe) and report its validation loss
the way `transformer-lab eval` does, to compare what the two implementations learn.

    python3 bench/pytorch/train_char.py --data-dir DATA [--seed 1337] [--threads 2]

The model, optimizer and batches are those of train_bench.py (experiments/shakespeare-char.json);
the schedule is nanoGPT's get_lr (100 warmup steps, cosine from 1e-3 to 1e-4 over 2000 steps);
batches are drawn at random offsets like nanoGPT's get_batch. The validation loss is the mean
cross-entropy over the last 10% of the text cut into windows of 64 that share no target, the
whole split (as `eval`), and nanoGPT's 20-batch estimate.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

from train_bench import Gpt, adamw


def lr_at(step, lr=1e-3, min_lr=1e-4, warmup=100, decay=2000):
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    text = open(f"{args.data_dir}/tinyshakespeare/input.txt").read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text])
    cut = int(0.9 * len(ids))
    train, valid = ids[:cut], ids[cut:]
    batch, context = 12, 64

    model = Gpt(len(chars))
    opt = adamw(model)

    def windows(data, starts):
        x = torch.stack([data[s : s + context] for s in starts])
        y = torch.stack([data[s + 1 : s + 1 + context] for s in starts])
        return x, y

    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = windows(train, torch.randint(len(train) - context - 1, (batch,)).tolist())
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step}: train loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        starts = list(range(0, len(valid) - context, context))
        total, count = 0.0, 0
        for i in range(0, len(starts), 256):
            x, y = windows(valid, starts[i : i + 256])
            total += model(x, y).item() * y.numel()
            count += y.numel()
        estimate = sum(
            model(*windows(valid, torch.randint(len(valid) - context - 1, (batch,)).tolist())).item()
            for _ in range(20)
        ) / 20
    print(
        f"seed {args.seed}: {args.steps} steps in {seconds:.0f} s; validation loss {total / count:.4f} over "
        f"{count} tokens (whole split), {estimate:.4f} (nanoGPT's 20-batch estimate)"
    )


if __name__ == "__main__":
    main()
