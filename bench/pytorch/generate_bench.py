"""Hugging Face transformers' GPT-2 `generate()`, timed like `transformer-lab bench generate`.

Kept apart from the project (not a dependency of anything): it measures transformers on the
same machine, in the same sitting, at the same shape, so the two can be interleaved.

    python3 bench/pytorch/generate_bench.py [--threads 2] [--d-model 384] [--layers 6] [--heads 6]
        [--context 256] [--vocab 65] [--prompt-len 1] [--tokens 255] [--batch 1,8] [--runs 3]
        [--cached-only] [--device cpu|cuda]

Model: `GPT2LMHeadModel` with random weights at the `shakespeare-char-gpu` shape (6 layers,
6 heads, d_model 384, context 256, vocabulary 65), eval mode, float32. Decoding is greedy
(`do_sample=False`) with exactly `--tokens` new tokens (`min_new_tokens`), with the KV cache
(`use_cache=True`) and without it. Prefill is the time of `generate(max_new_tokens=1)`; the
per-token time is the rest of a full generation divided by the remaining tokens. Prints the
medians of `--runs` timed runs after one warm-up.
"""

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--prompt-len", type=int, default=1)
    p.add_argument("--tokens", type=int, default=255)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cached-only", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args()
    device = torch.device(a.device)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=a.vocab,
        n_positions=a.context,
        n_embd=a.d_model,
        n_layer=a.layers,
        n_head=a.heads,
        n_inner=4 * a.d_model,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval().to(device)
    where = f"{a.threads} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"transformers {__import__('transformers').__version__} GPT-2 generate on torch "
        f"{torch.__version__}, {where}: d_model {a.d_model}, {a.layers} layers, "
        f"{a.heads} heads, {a.prompt_len} prompt token(s), {a.tokens} new, greedy; "
        f"median of {a.runs} runs"
    )
    print(f"{'decoding':<10} {'batch':>5} {'prefill ms':>12} {'per-token ms':>14} {'total s':>10} {'tokens/s':>10}")
    for batch in [int(b) for b in a.batch.split(",")]:
        prompt = torch.randint(0, a.vocab, (batch, a.prompt_len)).to(device)
        mask = torch.ones_like(prompt)
        for use_cache in [True] if a.cached_only else [True, False]:

            def gen(n):
                with torch.inference_mode():
                    start = time.perf_counter()
                    out = model.generate(
                        prompt,
                        attention_mask=mask,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        use_cache=use_cache,
                    )
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                assert out.shape == (batch, a.prompt_len + n)
                return elapsed

            gen(a.tokens)  # warm-up
            prefill = statistics.median(gen(1) for _ in range(max(a.runs, 5)))
            totals = [gen(a.tokens) for _ in range(a.runs)]
            total = statistics.median(totals)
            per_token = (total - prefill) / max(a.tokens - 1, 1)
            name = "cached" if use_cache else "recompute"
            print(
                f"{name:<10} {batch:>5} {prefill * 1e3:>12.2f} {per_token * 1e3:>14.3f} "
                f"{total:>10.3f} {batch * a.tokens / total:>10.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
