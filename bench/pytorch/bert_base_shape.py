"""A BertForMaskedLM at bert-base-uncased's shape (12 layers, 12 heads, width 768, vocabulary
30,522, 512 positions) with random weights (the real ones cannot be downloaded everywhere), for
checking `import bert` at full size: it saves the checkpoint and prints transformers' top-5
fill-mask tokens, their probabilities and the time per sentence, to compare with
`transformer-lab fill-mask` on the imported artifact.

    python bert_base_shape.py PATH/TO/multi30k/train.en.gz OUT_DIR
"""
import gzip
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

lines = gzip.open(sys.argv[1], "rt", encoding="utf-8").read().splitlines()
out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)

# bert-base-uncased's layout of specials: [PAD] 0, [unused0..98], [UNK] 100, [CLS] 101,
# [SEP] 102, [MASK] 103, then words; filled to 30,522 with further [unused] entries.
wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
wordpiece.train_from_iterator(
    lines, trainers.WordPieceTrainer(vocab_size=20000, special_tokens=["[UNK]"], show_progress=False)
)
words = [t for t, _ in sorted(wordpiece.get_vocab().items(), key=lambda x: x[1]) if t != "[UNK]"]
vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
vocab += [f"[unused{i}]" for i in range(99, 99 + 30522 - len(vocab))]
tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
tokenizer.decoder = decoders.WordPiece()
tokenizer.post_processor = processors.TemplateProcessing(
    single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 101), ("[SEP]", 102)]
)
fast = BertTokenizerFast(tokenizer_object=tokenizer)
fast.save_pretrained(out)

torch.manual_seed(0)
model = BertForMaskedLM(BertConfig()).eval()  # bert-base-uncased's config
with torch.no_grad():
    # BERT's init gives near-uniform scores: widen the weights so the top tokens stand out.
    for name, p in model.named_parameters():
        if not (name.endswith("bias") or "LayerNorm" in name):
            p.mul_(4.0)
model.save_pretrained(out, safe_serialization=True)

sentences = ["a man sits on the [MASK] of the river .", "two [MASK] are running through the grass"]
torch.set_num_threads(2)
with torch.no_grad():
    for text in sentences:
        x = fast(text, return_tensors="pt")
        start = time.perf_counter()
        logits = model(**x).logits[0]
        ms = 1000 * (time.perf_counter() - start)
        at = (x["input_ids"][0] == fast.mask_token_id).nonzero()[0, 0]
        top = logits[at].softmax(-1).topk(5)
        tokens = [fast.decode([i]) for i in top.indices.tolist()]
        print(text, [f"{t} {p:.3f}" for t, p in zip(tokens, top.values.tolist())], f"{ms:.0f} ms")
