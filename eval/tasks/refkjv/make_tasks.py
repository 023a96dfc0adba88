"""Make the reference model's lm-eval tasks from its held-out chapters (deterministic).

    .venv/bin/python -m eval.tasks.refkjv.make_tasks

Writes next_verse.jsonl, last_word.jsonl, continue.jsonl, needle.jsonl and needle_control.jsonl beside this
file and prints their sha256 (also kept in digests.json, which the tests check). All draw only on
refmodel/data/heldout.jsonl, which the model never saw. The multiple-choice tasks have four choices each, so
chance is 25%.
- refkjv_next_verse: up to three verses, then which of four verses follows them (three are verses
  of about the same length from other chapters).
- refkjv_last_word: a verse without its last word, then which of four words ends it (the distractors
  are last words of other held-out verses, so every choice is a plausible verse ending).
- refkjv_continue: a verse and the first words of the next, then the rest of that verse, generated
  greedily (lm-eval's generate_until) and scored against the real text: where quantization shows first.
- refkjv_needle: a long-context probe. A verse (the needle) opens a context filled with verses of other
  chapters to NEEDLE_PROMPT_TOKENS of the model's 512 positions, which ends with the needle's first words;
  scored by the log-likelihood of the needle's rest. refkjv_needle_control is the same items without the
  needle: what a model scores without retrieving anything; the gain over it is what retrieval from the
  start of the context (through every position of the KV cache) is worth.
"""

from __future__ import annotations

import hashlib
import json
import random
from bisect import bisect_left, bisect_right
from pathlib import Path

from refmodel import corpus

HERE = Path(__file__).resolve().parent
CHOICES = 4
CONTEXT_VERSES = 3
SEED = 20261130
# Each task is scored in rounds of the gate's order until its verdict is known (eval/quality/rounds.py), so a build pays
# only for the documents its verdict needs, while the baseline scores every one. A larger pool lets a build half a
# point or more clear of its threshold be decided within it (docs/gate.md): next verse and last word take every
# held-out verse, continue every second verse pair (no verse in two items).
CONTINUE_MAX_WORDS = 24  # continuations the task's max_gen_toks (64) holds whole
NEEDLE_ITEMS = 200  # drawn from the verses whose rest is 3-24 words, each with a haystack of its own
NEEDLE_PROMPT_TOKENS = 440  # with the 64 tokens the task may generate, the context's 512 positions all but filled
TOKENIZER = HERE.parents[2] / "refmodel" / "ref-lm" / "tokenizer.json"


def _write(path: Path, rows: list[dict]) -> str:
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(body, encoding="utf-8")
    return hashlib.sha256(body.encode()).hexdigest()


def next_verse_items(chapters: list[corpus.Chapter], rng: random.Random) -> list[dict]:
    """Distractors are verses of other chapters of about the same length (within 15%), so that a
    model cannot win by preferring short verses: only the context tells the answer."""
    items = []
    for ci, chapter in enumerate(chapters):
        verses = chapter.text.split("\n")
        others = sorted((len(v), v) for cj, c in enumerate(chapters) if cj != ci for v in c.text.split("\n"))
        lengths = [n for n, _ in others]
        for i in range(len(verses) - 1):
            target = verses[i + 1]
            # the lengths within 15 % found by bisection (a character either side), then the rule itself
            near = others[bisect_left(lengths, 0.85 * len(target) - 1) : bisect_right(lengths, 1.15 * len(target) + 1)]
            alike = sorted({v for n, v in near if abs(n - len(target)) <= 0.15 * len(target) and v != target})
            if len(alike) < CHOICES - 1:
                continue
            choices = [target, *rng.sample(alike, CHOICES - 1)]
            rng.shuffle(choices)
            context = "\n".join(verses[max(0, i - CONTEXT_VERSES + 1) : i + 1])
            items.append({"context": context, "choices": choices, "label": choices.index(target)})
    return items  # whole: the build that ships can need every item (fp8 on a Xeon with AMX, docs/results.md)


def last_word_items(chapters: list[corpus.Chapter], rng: random.Random) -> list[dict]:
    verses = [v for c in chapters for v in c.text.split("\n")]
    split = [v.rstrip(".;:,?!").rsplit(" ", 1) for v in verses]
    endings = sorted({w for _, w in split})
    items = []
    for head, word in split:
        if len(head.split()) < 4:
            continue
        distractors = rng.sample([w for w in endings if w.lower() != word.lower()], CHOICES - 1)
        choices = [word, *distractors]
        rng.shuffle(choices)
        items.append({"context": head, "choices": choices, "label": choices.index(word)})
    return items


def continue_items(chapters: list[corpus.Chapter], rng: random.Random) -> list[dict]:
    """A verse, then the first third (at least two words) of the next one; the target is the rest of it. Each
    chapter's verses in disjoint pairs (first and second, third and fourth, ...): no verse is in two items."""
    items = []
    for chapter in chapters:
        verses = chapter.text.split("\n")
        for previous, verse in zip(verses[0::2], verses[1::2], strict=False):
            words = verse.split(" ")
            shown = max(2, len(words) // 3)
            if not 3 <= len(words) - shown <= CONTINUE_MAX_WORDS:
                continue
            start, rest = " ".join(words[:shown]), " ".join(words[shown:])
            items.append({"context": previous + "\n" + start, "target": " " + rest})
    return items  # half the pairs the text gives: no build decided on this task has needed more (docs/results.md)


def needle_items(chapters: list[corpus.Chapter], rng: random.Random, needle: bool = True) -> list[dict]:
    """The needle: a verse of one chapter whose rest (after its first third) is 3-24 words; the haystack:
    verses of the other chapters, in text order from a random place, added while the prompt stays within
    NEEDLE_PROMPT_TOKENS of ref-lm's tokenizer (lm-eval would cut a longer one from the left: the needle
    first). `needle=False`: the same haystack and question without the needle."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    candidates = [
        (ci, verse)
        for ci, c in enumerate(chapters)
        for verse in c.text.split("\n")
        if 3 <= len(verse.split(" ")) - max(2, len(verse.split(" ")) // 3) <= CONTINUE_MAX_WORDS
    ]
    items = []
    for ci, verse in sorted(rng.sample(candidates, NEEDLE_ITEMS)):
        words = verse.split(" ")
        shown = max(2, len(words) // 3)
        start, rest = " ".join(words[:shown]), " ".join(words[shown:])
        others = [v for cj, c in enumerate(chapters) if cj != ci for v in c.text.split("\n")]
        at = rng.randrange(len(others))
        hay: list[str] = []
        for v in others[at:] + others[:at]:
            if count("\n".join([verse, *hay, v, start])) > NEEDLE_PROMPT_TOKENS:
                break
            hay.append(v)
        context = "\n".join(([verse] if needle else []) + hay + [start])
        items.append({"context": context, "target": " " + rest})
    return items


def main() -> None:
    chapters = corpus.read_jsonl(corpus.HELDOUT_FILE)
    digests = {
        "next_verse.jsonl": _write(HERE / "next_verse.jsonl", next_verse_items(chapters, random.Random(SEED))),
        "last_word.jsonl": _write(HERE / "last_word.jsonl", last_word_items(chapters, random.Random(SEED + 1))),
        "continue.jsonl": _write(HERE / "continue.jsonl", continue_items(chapters, random.Random(SEED + 2))),
        "needle.jsonl": _write(HERE / "needle.jsonl", needle_items(chapters, random.Random(SEED + 3))),
        "needle_control.jsonl": _write(
            HERE / "needle_control.jsonl", needle_items(chapters, random.Random(SEED + 3), needle=False)
        ),
    }
    (HERE / "digests.json").write_text(json.dumps(digests, indent=2) + "\n")
    print(json.dumps(digests, indent=2))


if __name__ == "__main__":
    main()
