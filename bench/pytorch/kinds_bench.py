"""The translator, sentence classifier and ViT training steps in PyTorch, timed like
`transformer-lab bench train -e experiments/{multi30k-de-en-cpu,sst2,vit-mnist,clip-mnist-fashion}.json`.

Kept apart from the project (nothing depends on it): it measures PyTorch on the same machine, in
the same sitting, with models, optimizers and batches of the same shape and recipe.

    python3 bench/pytorch/kinds_bench.py translator|classifier|vit|clip --data-dir DATA
        [--threads 2] [--steps 20] [--warmup 5] [--runs 3] [--by-length]

- translator (multi30k-de-en-cpu): `nn.Transformer`, 2+2 pre-norm layers, d 128, 4 heads,
  d_ff 512, ReLU, dropout 0.1, sinusoidal positions, one shared 8k byte-level BPE (the same
  `tokenizers` trainer and settings as ours) with tied input/output embeddings, label smoothing
  0.1 ignoring padding; AdamW lr 1e-3, betas 0.9/0.98, eps 1e-9, decay 0.01; batch 64 pairs.
  Counts target tokens (what the decoder predicts, padding excluded).
- classifier (sst2): learned positions, 2 pre-norm `nn.TransformerEncoderLayer`s, d 128, 4 heads,
  d_ff 256, GELU, dropout 0.2, final LayerNorm, mean pooling over real tokens, `<s>` first,
  8k BPE, at most 64 tokens; AdamW lr 5e-4, betas 0.9/0.99, decay 0.1; batch 64 sentences.
- vit (vit-mnist): 7×7 patches by a strided convolution, `[CLS]`, learned positions, 4 pre-norm
  layers, d 64, 4 heads, d_ff 128, GELU, no dropout, final LayerNorm, CLS pooling; AdamW lr 2e-3,
  betas 0.9/0.99, decay 0.05; batch 128 images.
- clip (clip-mnist-fashion): the vit above as image encoder (its head a 64-wide projection
  without bias) and a text encoder over `<s> caption </s>` (learned positions, 2 pre-norm
  layers, d 64, 4 heads, d_ff 128, GELU, no dropout, final LayerNorm, pooled at `</s>`, a
  projection without bias), L2-normalised, scaled by exp(learned log-scale) clamped at 100,
  symmetric InfoNCE; captions of the 20 classes of MNIST + Fashion-MNIST from the same kind of
  templates, a 400-token BPE; AdamW lr 2e-3, betas 0.9/0.98, decay 0.05; batch 256 pairs.

All: weight decay on matrices only, global-norm clipping 1.0, batches padded to their longest
item, drawn uniformly with replacement (`--by-length`: an epoch of 500 batches' items sorted by
length, cut into 500 batches of about equal tokens, the batches shuffled — what
`train.batch_by_length` does), built before
timing. Prints items/s (median of the runs) and the forward / backward / optimizer split.
"""

import argparse
import gzip
import math
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, BOS, EOS = 0, 1, 2
STEPS_PER_EPOCH = 500


def bpe(texts, vocab_size=8000):
    """Our tokenizer: byte-level BPE, NFC, specials <pad> <s> </s> <unk> first."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def pad(rows):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


def draw(n_items, batch, n_batches, key=None, seed=1337):
    """`n_batches` batches of indices drawn with replacement; by length when `key` is given."""
    rng = random.Random(seed)
    if key is None:
        return [[rng.randrange(n_items) for _ in range(batch)] for _ in range(n_batches)]
    drawn = sorted((rng.randrange(n_items) for _ in range(STEPS_PER_EPOCH * batch)), key=lambda i: key[i])
    # Cut into STEPS_PER_EPOCH runs of about equal tokens, as `train.batch_by_length` does.
    total, runs, start, acc = sum(key[i] for i in drawn), [], 0, 0
    for at, i in enumerate(drawn):
        acc += key[i]
        k, left = len(runs) + 1, len(drawn) - at - 1
        if k < STEPS_PER_EPOCH and (acc * STEPS_PER_EPOCH >= k * total or left == STEPS_PER_EPOCH - k) and left >= STEPS_PER_EPOCH - k:
            runs.append(drawn[start : at + 1])
            start = at + 1
    runs.append(drawn[start:])
    rng.shuffle(runs)
    return runs[:n_batches]


def adamw(model, lr, betas, decay, eps=1e-8):
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def sinusoids(n, d):
    pos = torch.arange(n).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class Translator(nn.Module):
    def __init__(self, vocab, d=128, h=4, layers=2, d_ff=512, dropout=0.1, max_len=128):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(vocab, d)
        self.register_buffer("pe", sinusoids(max_len, d))
        self.drop = nn.Dropout(dropout)
        self.core = nn.Transformer(d, h, layers, layers, d_ff, dropout, batch_first=True, norm_first=True)

    def forward(self, src, tgt_in, tgt_out):
        embed = lambda ids: self.drop(self.emb(ids) * math.sqrt(self.d) + self.pe[: ids.shape[1]])
        src_pad, tgt_pad = src == PAD, tgt_in == PAD
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        y = self.core(
            embed(src),
            embed(tgt_in),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        logits = y @ self.emb.weight.T
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1), ignore_index=PAD, label_smoothing=0.1
        )


def encoder(d, h, layers, d_ff, dropout):
    layer = nn.TransformerEncoderLayer(d, h, d_ff, dropout, activation="gelu", batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)


class Classifier(nn.Module):
    def __init__(self, vocab, classes=2, d=128, h=4, layers=2, d_ff=256, dropout=0.2, max_len=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(dropout)
        self.encoder = encoder(d, h, layers, d_ff, dropout)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, labels):
        padding = tokens == PAD
        x = self.drop(self.emb(tokens) + self.pos(torch.arange(tokens.shape[1])))
        x = self.encoder(x, src_key_padding_mask=padding)
        real = (~padding).unsqueeze(-1).float()
        pooled = (x * real).sum(1) / real.sum(1)
        return F.cross_entropy(self.head(pooled), labels)


class Vit(nn.Module):
    def __init__(self, classes=10, patch=7, size=28, d=64, h=4, layers=4, d_ff=128):
        super().__init__()
        self.patches = nn.Conv2d(1, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, d) * 0.02)
        self.encoder = encoder(d, h, layers, d_ff, 0.0)
        self.head = nn.Linear(d, classes)

    def forward(self, images, labels):
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return F.cross_entropy(self.head(self.encoder(x)[:, 0]), labels)


class TextTower(nn.Module):
    def __init__(self, vocab, out=64, d=64, h=4, layers=2, d_ff=128, max_len=24):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.encoder = encoder(d, h, layers, d_ff, 0.0)
        self.proj = nn.Linear(d, out, bias=False)

    def forward(self, tokens):
        padding = tokens == PAD
        x = self.encoder(self.emb(tokens) + self.pos(torch.arange(tokens.shape[1])), src_key_padding_mask=padding)
        last = (~padding).sum(1) - 1
        return self.proj(x[torch.arange(x.shape[0]), last])


class Clip(nn.Module):
    def __init__(self, vocab, out=64):
        super().__init__()
        self.image = Vit(classes=out)
        self.image.head = nn.Linear(64, out, bias=False)
        self.text = TextTower(vocab, out)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images, tokens):
        x = self.image.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.image.cls.expand(x.shape[0], -1, -1), x], 1) + self.image.pos
        i = F.normalize(self.image.head(self.image.encoder(x)[:, 0]), dim=-1)
        t = F.normalize(self.text(tokens), dim=-1)
        logits = self.log_scale.exp().clamp(max=100) * i @ t.T
        targets = torch.arange(len(logits))
        return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def lines(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.strip() for line in f.read().split("\n")]


def translator(args, n):
    root = args.data_dir / "multi30k"
    de, en = lines(root / "train.de.gz"), lines(root / "train.en.gz")
    pairs = [(s, t) for s, t in zip(de, en) if s and t]
    tok = bpe([s for s, _ in pairs] + [t for _, t in pairs])
    items = []
    for s, t in pairs:
        src, tgt = tok.encode(s).ids, tok.encode(t).ids
        if src and tgt and len(src) + 1 <= 100 and len(tgt) + 1 <= 100:
            items.append((src + [EOS], tgt))
    key = [max(len(s), len(t) + 1) for s, t in items]
    batches = []
    for idx in draw(len(items), 64, n, key if args.by_length else None):
        rows = [items[i] for i in idx]
        tgt_out = pad([t + [EOS] for _, t in rows])
        batches.append(((pad([s for s, _ in rows]), pad([[BOS] + t for _, t in rows]), tgt_out), int((tgt_out != PAD).sum())))
    model = lambda: Translator(tok.get_vocab_size())
    opt = lambda m: adamw(m, 1e-3, (0.9, 0.98), 0.01, eps=1e-9)
    return batches, model, opt, "target tokens"


def classifier(args, n):
    rows = (args.data_dir / "sst2" / "glue" / "train.tsv").read_text(encoding="utf-8").split("\n")[1:]
    data = [(r.rsplit("\t", 1)[0].strip(), int(r.rsplit("\t", 1)[1])) for r in rows if r.strip()]
    tok = bpe([t for t, _ in data])
    items = [([BOS] + tok.encode(t).ids)[:64] for t, _ in data]
    key = [len(i) for i in items]
    batches = []
    for idx in draw(len(items), 64, n, key if args.by_length else None):
        batches.append(((pad([items[i] for i in idx]), torch.tensor([data[i][1] for i in idx])), len(idx)))
    return batches, lambda: Classifier(tok.get_vocab_size()), lambda m: adamw(m, 5e-4, (0.9, 0.99), 0.1), "sentences"


def vit(args, n):
    root = args.data_dir / "mnist"
    with gzip.open(root / "train-images-idx3-ubyte.gz") as f:
        images = torch.frombuffer(bytearray(f.read()[16:]), dtype=torch.uint8).view(-1, 1, 28, 28)
    with gzip.open(root / "train-labels-idx1-ubyte.gz") as f:
        labels = torch.frombuffer(bytearray(f.read()[8:]), dtype=torch.uint8).long()
    batches = []
    for idx in draw(len(labels), 128, n):
        idx = torch.tensor(idx)
        batches.append(((images[idx].float() / 255.0, labels[idx]), len(idx)))
    return batches, Vit, lambda m: adamw(m, 2e-3, (0.9, 0.99), 0.05), "images"


CLASS_NAMES = [
    ["zero", "0"], ["one", "1"], ["two", "2"], ["three", "3"], ["four", "4"],
    ["five", "5"], ["six", "6"], ["seven", "7"], ["eight", "8"], ["nine", "9"],
    ["t-shirt", "top"], ["trousers", "pants"], ["pullover", "sweater"], ["dress", "gown"],
    ["coat", "jacket"], ["sandal", "open shoe"], ["shirt", "blouse"], ["sneaker", "running shoe"],
    ["bag", "handbag"], ["ankle boot", "boot"],
]
TEMPLATES = [
    ["a handwritten {}", "the number {} written by hand", "a photo of the digit {}", "a {} written with a pen"],
    ["a photo of a {}", "a {} on a dark background", "a grey photo of a {}", "a product photo of a {}"],
]


def clip(args, n):
    images, labels = [], []
    for offset, name in [(0, "mnist"), (10, "fashion-mnist")]:
        root = args.data_dir / name
        with gzip.open(root / "train-images-idx3-ubyte.gz") as f:
            images.append(torch.frombuffer(bytearray(f.read()[16:]), dtype=torch.uint8).view(-1, 1, 28, 28))
        with gzip.open(root / "train-labels-idx1-ubyte.gz") as f:
            labels.append(torch.frombuffer(bytearray(f.read()[8:]), dtype=torch.uint8).long() + offset)
    images, labels = torch.cat(images), torch.cat(labels)
    captions = [[t.format(n) for t in TEMPLATES[c // 10] for n in names] for c, names in enumerate(CLASS_NAMES)]
    tok = bpe([c for pool in captions for c in pool] * 4, vocab_size=400)
    pools = [[[BOS] + tok.encode(c).ids + [EOS] for c in pool] for pool in captions]
    rng = random.Random(1337)
    batches = []
    for idx in draw(len(labels), 256, n):
        rows = [rng.choice(pools[int(labels[i])]) for i in idx]
        idx = torch.tensor(idx)
        batches.append(((images[idx].float() / 127.5 - 1.0, pad(rows)), len(idx)))
    model = lambda: Clip(tok.get_vocab_size())
    return batches, model, lambda m: adamw(m, 2e-3, (0.9, 0.98), 0.05), "pairs"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["translator", "classifier", "vit", "clip"])
    ap.add_argument("--data-dir", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--by-length", action="store_true", help="batches grouped by length (text models)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    make = {"translator": translator, "classifier": classifier, "vit": vit, "clip": clip}[args.model]
    batches, new_model, new_opt, unit = make(args, args.warmup + args.steps)
    units = sum(u for _, u in batches[args.warmup :])

    speeds, splits = [], []
    for _ in range(args.runs):
        model = new_model()
        model.train()
        opt = new_opt(model)
        times = []
        for step, (inputs, _) in enumerate(batches):
            t0 = time.perf_counter()
            loss = model(*inputs)
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            t3 = time.perf_counter()
            if step >= args.warmup:
                times.append((t1 - t0, t2 - t1, t3 - t2))
        speeds.append(units / sum(sum(t) for t in times))
        splits.extend(times)
    fwd, bwd, opt_t = (statistics.median(t[i] for t in splits) * 1e3 for i in range(3))
    print(
        f"pytorch {torch.__version__} {args.model}, {args.threads} threads{', by length' if args.by_length else ''}: "
        f"{statistics.median(speeds):.0f} {unit}/s (median of {args.runs} runs: {', '.join(f'{s:.0f}' for s in speeds)}; "
        f"{units / args.steps:.0f} {unit} per step)"
    )
    print(f"median step {fwd + bwd + opt_t:.1f} ms = forward {fwd:.1f} + backward {bwd:.1f} + optimizer {opt_t:.1f}")


if __name__ == "__main__":
    main()
