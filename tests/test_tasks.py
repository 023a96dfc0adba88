"""The reference model's local lm-eval tasks: deterministic, committed, held-out only."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
from helpers import REPO

from eval.tasks.refkjv import make_tasks
from refmodel import corpus

TASKS = REPO / "eval/tasks/refkjv"


def test_committed_task_data_matches_its_digests():
    digests = json.loads((TASKS / "digests.json").read_text())
    for name, digest in digests.items():
        assert hashlib.sha256((TASKS / name).read_bytes()).hexdigest() == digest


@pytest.mark.slow  # regenerates every task file from the 119 held-out chapters (seconds: out of the unit tier)
def test_generator_reproduces_the_committed_files(tmp_path):
    chapters = corpus.read_jsonl(corpus.HELDOUT_FILE)
    made = {
        "next_verse.jsonl": make_tasks._write(
            tmp_path / "n.jsonl", make_tasks.next_verse_items(chapters, random.Random(make_tasks.SEED))
        ),
        "last_word.jsonl": make_tasks._write(
            tmp_path / "l.jsonl", make_tasks.last_word_items(chapters, random.Random(make_tasks.SEED + 1))
        ),
        "continue.jsonl": make_tasks._write(
            tmp_path / "c.jsonl", make_tasks.continue_items(chapters, random.Random(make_tasks.SEED + 2))
        ),
        "needle.jsonl": make_tasks._write(
            tmp_path / "h.jsonl", make_tasks.needle_items(chapters, random.Random(make_tasks.SEED + 3))
        ),
        "needle_control.jsonl": make_tasks._write(
            tmp_path / "k.jsonl", make_tasks.needle_items(chapters, random.Random(make_tasks.SEED + 3), needle=False)
        ),
    }
    assert made == json.loads((TASKS / "digests.json").read_text())


def test_items_are_well_formed_and_come_from_held_out_text():
    heldout = "\n".join(c.text for c in corpus.read_jsonl(corpus.HELDOUT_FILE))
    for name in ("next_verse.jsonl", "last_word.jsonl"):
        rows = [json.loads(line) for line in (TASKS / name).read_text().splitlines()]
        assert len(rows) > 2700  # every held-out verse: next verse 2,798, last word 2,919
        labels = [r["label"] for r in rows]
        assert all(len(r["choices"]) == 4 and len(set(r["choices"])) == 4 for r in rows)
        assert all(0.2 < labels.count(k) / len(rows) < 0.3 for k in range(4))  # the answer is not positional
        assert all(r["context"] in heldout for r in rows[:50])


def test_continuations_are_the_rest_of_a_held_out_verse():
    heldout = corpus.read_jsonl(corpus.HELDOUT_FILE)
    verses = {v for c in heldout for v in c.text.split("\n")}
    rows = [json.loads(line) for line in (TASKS / "continue.jsonl").read_text().splitlines()]
    assert len(rows) > 1100  # every second pair of held-out verses whose second one's rest is 3-24 words
    for r in rows:
        previous, start = r["context"].split("\n")
        assert previous in verses and start + r["target"] in verses  # the target completes the verse
        assert 3 <= len(r["target"].split()) <= make_tasks.CONTINUE_MAX_WORDS


def test_a_needle_opens_a_full_context_and_its_control_lacks_only_it():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(make_tasks.TOKENIZER))
    verses = {v for c in corpus.read_jsonl(corpus.HELDOUT_FILE) for v in c.text.split("\n")}
    needles = [json.loads(line) for line in (TASKS / "needle.jsonl").read_text().splitlines()]
    controls = [json.loads(line) for line in (TASKS / "needle_control.jsonl").read_text().splitlines()]
    assert len(needles) == len(controls) == make_tasks.NEEDLE_ITEMS
    for n, c in zip(needles, controls, strict=True):
        needle, *hay, start = n["context"].split("\n")
        assert needle == start + n["target"] and needle in verses  # the question is the needle's start
        assert c == {"context": "\n".join([*hay, start]), "target": n["target"]}  # the same, without the needle
        assert needle not in hay and len(hay) >= 5
        tokens = len(tokenizer.encode(n["context"], add_special_tokens=False).ids)
        # far back (the needle is most of the context away), and room left for the target in 512 positions
        assert 350 <= tokens <= make_tasks.NEEDLE_PROMPT_TOKENS


def test_perplexity_scores_every_sixth_held_out_chapter():
    import datasets

    from eval.tasks.refkjv.utils import PPL_EVERY, ppl_chapters

    texts = [c.text for c in corpus.read_jsonl(corpus.HELDOUT_FILE)]
    kept = ppl_chapters(datasets.Dataset.from_list([{"text": t} for t in texts]))
    assert PPL_EVERY == 6 and kept["text"] == texts[::6] and len(kept) == 20


def test_the_needle_scores_bits_per_byte_of_its_rest():
    from eval.tasks.refkjv.utils import needle_results

    assert needle_results({"target": " and the waters"}, [(-12.5, False)]) == {"bits_per_byte": (-12.5, 15)}


def test_a_continuation_scores_exact_match_and_chrf_per_document():
    from eval.tasks.refkjv.utils import process_results

    doc = {"target": " and the waters were abated."}
    assert process_results(doc, [" and the waters were abated. "]) == {"exact_match": 1.0, "chrf": 1.0}
    near, far = (process_results(doc, [g]) for g in (" and the waters were abated", " a great city"))
    assert near["exact_match"] == far["exact_match"] == 0.0
    assert 0.0 <= far["chrf"] < near["chrf"] < 1.0  # a late departure scores near the text, an early one far


def test_the_task_folders_scoring_code_is_part_of_its_identity():
    from eval.quality.lm_tasks import task_files

    names = [p.name for p in task_files(TASKS, REPO)]
    assert {"refkjv_continue.yaml", "continue.jsonl", "needle_control.jsonl", "utils.py"} <= set(
        names
    )  # editing the scoring reruns
