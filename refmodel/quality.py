"""Held-out bits per byte of `ref-lm` beside a unigram model's, on the same held-out chapters.

    .venv/bin/python -m refmodel.quality

The unigram model is the training split's token frequencies (add-one smoothed, counts stored in
refmodel/data/unigram_counts.json by the training script). The model is scored the way
lm-eval's rolling log-likelihood does: each chapter in windows of at most the model's context, the
first window starting from the end-of-text token. Bits per byte divide by the chapter's UTF-8 bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from refmodel import corpus

UNIGRAM_FILE = corpus.DATA_DIR / "unigram_counts.json"


def unigram_bits(counts: Sequence[int], token_ids: Sequence[int]) -> float:
    """Total bits of `token_ids` under an add-one smoothed unigram model with these counts."""
    total = sum(counts) + len(counts)
    return -sum(math.log2((counts[t] + 1) / total) for t in token_ids)


@torch.no_grad()
def model_bits(model: torch.nn.Module, token_ids: Sequence[int], prefix_id: int, window: int) -> float:
    """Total bits of `token_ids` under a causal LM, scored in disjoint windows of `window` tokens."""
    ids = torch.tensor([prefix_id, *token_ids], dtype=torch.long)
    nats = 0.0
    for start in range(0, len(token_ids), window):
        inp = ids[start : start + window].unsqueeze(0)
        target = ids[start + 1 : start + window + 1]
        logits = model(input_ids=inp).logits[0, : target.numel()].float()
        nats += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
    return nats / math.log(2)


def measure_quality(model_dir: Path, every: int = 1) -> dict:
    """Bits per byte of the model and of the unigram baseline on the held-out split (every `every`-th chapter of
    it: quality.json keeps the figures of all of them and of every SAMPLE_EVERY-th, which the tests check)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    counts = json.loads(UNIGRAM_FILE.read_text())["counts"]
    window = model.config.max_position_embeddings
    docs = corpus.read_jsonl(corpus.HELDOUT_FILE)[::every]
    n_bytes = n_tokens = 0
    bits_model = bits_unigram = 0.0
    for doc in docs:
        ids = tokenizer.encode(doc.text, add_special_tokens=False)
        n_bytes += len(doc.text.encode("utf-8"))
        n_tokens += len(ids)
        bits_model += model_bits(model, ids, tokenizer.eos_token_id, window)
        bits_unigram += unigram_bits(counts, ids)
    return {
        "heldout_chapters": len(docs),
        "heldout_bytes": n_bytes,
        "heldout_tokens": n_tokens,
        "bytes_per_token": round(n_bytes / n_tokens, 3),
        "model_bits_per_byte": round(bits_model / n_bytes, 4),
        "unigram_bits_per_byte": round(bits_unigram / n_bytes, 4),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "bfloat16",
    }


SAMPLE_EVERY = 8  # quality.json's "sample": the same figures over every 8th held-out chapter (15 of 119)


def measure_all(model_dir: Path) -> dict:
    """quality.json's figures: over every held-out chapter, and over the sample the tests check."""
    q = measure_quality(model_dir)
    sample = measure_quality(model_dir, SAMPLE_EVERY)
    q["sample"] = {k: sample[k] for k in ("heldout_chapters", "model_bits_per_byte", "unigram_bits_per_byte")}
    return q


def main() -> None:
    q = measure_all(corpus.MODEL_DIR)
    size = f"{q['heldout_chapters']} chapters, {q['heldout_bytes']} bytes, {q['heldout_tokens']} tokens"
    print(f"held-out: {size}")
    print(f"ref-lm  bits per byte: {q['model_bits_per_byte']:.4f}")
    print(f"unigram bits per byte: {q['unigram_bits_per_byte']:.4f}")
    print(json.dumps(q))


if __name__ == "__main__":
    main()
