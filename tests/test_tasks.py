"""The reference model's local lm-eval tasks: deterministic, committed, held-out only."""

from __future__ import annotations

import hashlib
import json
import random

from helpers import REPO

from eval.tasks.refkjv import make_tasks
from refmodel import corpus

TASKS = REPO / "eval/tasks/refkjv"


def test_committed_task_data_matches_its_digests():
    digests = json.loads((TASKS / "digests.json").read_text())
    for name, digest in digests.items():
        assert hashlib.sha256((TASKS / name).read_bytes()).hexdigest() == digest


def test_generator_reproduces_the_committed_files(tmp_path):
    chapters = corpus.read_jsonl(corpus.HELDOUT_FILE)
    made = {
        "next_verse.jsonl": make_tasks._write(
            tmp_path / "n.jsonl", make_tasks.next_verse_items(chapters, random.Random(make_tasks.SEED))
        ),
        "last_word.jsonl": make_tasks._write(
            tmp_path / "l.jsonl", make_tasks.last_word_items(chapters, random.Random(make_tasks.SEED + 1))
        ),
    }
    assert made == json.loads((TASKS / "digests.json").read_text())


def test_items_are_well_formed_and_come_from_held_out_text():
    heldout = "\n".join(c.text for c in corpus.read_jsonl(corpus.HELDOUT_FILE))
    for name in ("next_verse.jsonl", "last_word.jsonl"):
        rows = [json.loads(line) for line in (TASKS / name).read_text().splitlines()]
        assert len(rows) > 1000
        labels = [r["label"] for r in rows]
        assert all(len(r["choices"]) == 4 and len(set(r["choices"])) == 4 for r in rows)
        assert all(0.2 < labels.count(k) / len(rows) < 0.3 for k in range(4))  # the answer is not positional
        assert all(r["context"] in heldout for r in rows[:50])
