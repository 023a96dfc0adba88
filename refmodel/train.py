"""Train the embedded reference model `ref-lm` from Debian's KJV text.

    apt-get install -y bible-kjv
    .venv/bin/python -m refmodel.train     # 1,000 steps, ~35 min on 2 CPU cores: the shipped model

Writes refmodel/data/{heldout,calibration}.jsonl and splits.json, the checkpoint in
refmodel/ref-lm/ (safetensors, bf16, with its tokenizer) and refmodel/data/quality.json. The
architecture is a small Llama whose every linear layer has an input width divisible by 128, so that
group-128 quantization applies to all of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from refmodel import corpus
from refmodel.quality import UNIGRAM_FILE, measure_all

log = logging.getLogger("refmodel.train")
MODEL_DIR = corpus.MODEL_DIR
EOT = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained on the training split only."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=512
    )


def model_config(vocab_size: int) -> LlamaConfig:
    # Input widths: 256 (q/k/v/o/gate/up, lm_head) and 768 (down): all divisible by 128.
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Documents joined as `<eot> doc <eot> doc ...`, the layout lm-eval's rolling windows start from."""
    ids: list[int] = []
    for text in texts:
        ids.append(tokenizer.eos_token_id)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def window_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    model.eval()
    loss = model(input_ids=windows, labels=windows).loss.item()
    model.train()
    return loss


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    splits = corpus.write_splits(corpus.parse_chapters(corpus.read_kjv()))
    log.info("splits: %s", {k: len(v) for k, v in splits.items()})
    train_texts = [c.text for c in splits["train"]]

    tokenizer = train_tokenizer(train_texts, args.vocab)
    stream = token_stream(tokenizer, train_texts)
    heldout = token_stream(tokenizer, [c.text for c in splits["heldout"]])
    counts = torch.bincount(stream, minlength=len(tokenizer)).tolist()
    UNIGRAM_FILE.write_text(json.dumps({"split": "train", "counts": counts}) + "\n")
    log.info("train tokens %d, held-out tokens %d", stream.numel(), heldout.numel())

    model = LlamaForCausalLM(model_config(len(tokenizer)))
    log.info("parameters: %.2fM", sum(p.numel() for p in model.parameters()) / 1e6)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    span = args.seq + 1
    val_starts = torch.arange(0, heldout.numel() - span, (heldout.numel() - span) // 16)[:16]
    val = torch.stack([heldout[s : s + args.seq] for s in val_starts])
    t0 = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, stream.numel() - span, (args.batch,), generator=gen)
        batch = torch.stack([stream[s : s + args.seq] for s in starts])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - t0
            log.info(
                "step %d/%d train %.3f held-out %.3f nats/token, %.0f tokens/s",
                step,
                args.steps,
                loss.item(),
                window_loss(model, val),
                (step + 1) * args.batch * args.seq / elapsed,
            )

    model = model.to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(MODEL_DIR, safe_serialization=True)
    tokenizer.save_pretrained(MODEL_DIR)
    quality = measure_all(MODEL_DIR)
    quality["training"] = {
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "seconds": round(time.perf_counter() - t0, 1),
        "train_tokens": stream.numel(),
        "seed": args.seed,
    }
    (corpus.DATA_DIR / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    log.info("quality: %s", json.dumps(quality))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="the shipped model: 1000 (refmodel/data/quality.json)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train(p.parse_args())


if __name__ == "__main__":
    main()
