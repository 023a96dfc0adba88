"""Tasks scored in rounds (eval/quality/rounds.py): the gate's order, a build stopped once its verdict is known, and the
gate's pairing of what it scored with the baseline's first documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.quality.paired import Bootstrap, Scored, Threshold, paired
from eval.quality.records import AccuracyResult, Metric, TaskRounds
from eval.quality.rounds import document_order
from eval.quality.sequential import scoring_order
from eval.quality.stats import Verdict

TASK = "refkjv_x"


def _side(
    folder: Path, scores: dict[int, float], rounds: TaskRounds | None, tasks: tuple[str, ...] = (TASK,)
) -> Scored:
    """An evaluation of `tasks` with these per-document 0/1 scores each, scored in rounds or not."""
    folder.mkdir(parents=True)
    rows = [{"doc_id": d, "metrics": ["acc"], "acc": v, "filter": "none"} for d, v in scores.items()]
    for task in tasks:
        (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = AccuracyResult(
        scores={t: [Metric(name="acc", value=sum(scores.values()) / len(scores))] for t in tasks},
        n_samples=dict.fromkeys(tasks, len(scores)),
        versions={},
        chance={},
        datasets={},
        backend="hf",
        lm_eval_version="test",
        seconds=0,
        peak_rss_mb=0,
        rounds=dict.fromkeys(tasks, rounds) if rounds else {},
    )
    return Scored(folder, result)


def _judge(base: Scored, build: Scored, *, subset: bool = True, threshold: float = 0.5):
    bootstrap = Bootstrap(0.95, 200, 0, every=100, sequential=True)
    return paired(TASK, base, build, threshold=Threshold(threshold), bootstrap=bootstrap, subset=subset)


def test_a_document_keeps_its_place_in_the_order_whatever_the_pool():
    order = document_order(1000, 0)
    assert sorted(order) == list(range(1000)) and order[:10] != list(range(10))
    assert [d for d in order if d < 400] == document_order(400, 0)  # a budget or a smaller pool: a prefix
    assert document_order(1000, 1) != order
    # the gate's order of a task's documents, and of its control's: the same
    keys = [(TASK, i) for i in range(1000)]
    assert (
        [i for _, i in scoring_order(keys, 0)]
        == order
        == [i for _, i in scoring_order([("c", i) for i in range(1000)], 0)]
    )


def test_a_build_that_stopped_is_judged_on_the_baselines_first_documents(tmp_path):
    pool = 400
    right = {d: float(d % 5 != 0) for d in range(pool)}  # 80 % right; the build answers alike
    base = _side(tmp_path / "base", right, TaskRounds(scored=pool, pool=pool, why="pool spent"))
    first = document_order(pool, 0)[:200]
    build = _side(tmp_path / "build", {d: right[d] for d in first}, TaskRounds(scored=200, pool=pool, why="decided"))
    c = _judge(base, build)
    assert (c.n, c.pool, c.verdict) == (200, pool, Verdict.PASS) and c.method == "betting"
    with pytest.raises(KeyError):  # the whole pool, or nothing: a build that stopped is not judged so
        _judge(base, build, subset=False)


def test_a_control_scored_on_its_tasks_documents_pairs_as_a_task_of_its_own(tmp_path):
    pool, tasks = 300, (TASK, "refkjv_x_control")
    right = {d: float(d % 4 != 0) for d in range(pool)}
    base = _side(tmp_path / "base", right, TaskRounds(scored=pool, pool=pool, why="pool spent"), tasks)
    first = document_order(pool, 0)[:100]
    build = _side(
        tmp_path / "build", {d: right[d] for d in first}, TaskRounds(scored=100, pool=pool, why="decided"), tasks
    )
    bootstrap = Bootstrap(0.95, 200, 0, every=100, sequential=True)
    for task, control in ((TASK, tasks[1]), (tasks[1], None)):
        c = paired(task, base, build, threshold=Threshold(0.5), bootstrap=bootstrap, control=control, subset=True)
        assert (c.n, c.pool) == (100, pool)


@pytest.mark.parametrize(
    "tamper",
    [
        "other documents",  # 200 of the pool, not the first of the order
        "a record lost",  # the last record of 200 removed: still a prefix, but not what the rounds scored
    ],
)
def test_documents_a_build_did_not_score_in_its_rounds_are_refused(tmp_path, tamper):
    pool = 400
    right = {d: float(d % 5 != 0) for d in range(pool)}
    base = _side(tmp_path / "base", right, TaskRounds(scored=pool, pool=pool, why="pool spent"))
    order = document_order(pool, 0)
    docs = order[200:] if tamper == "other documents" else order[:199]
    build = _side(tmp_path / "build", {d: right[d] for d in docs}, TaskRounds(scored=200, pool=pool, why="decided"))
    with pytest.raises(KeyError):
        _judge(base, build)


def test_a_cross_check_scored_by_index_is_any_of_the_documents(tmp_path):
    """Without rounds (a card whose builds never stop), a served cross-check's first documents by index pair."""
    right = {d: float(d % 5 != 0) for d in range(300)}
    base = _side(tmp_path / "base", right, None)
    build = _side(tmp_path / "build", {d: right[d] for d in range(60)}, None)
    assert _judge(base, build).n == 60
    with pytest.raises(KeyError):
        _judge(base, build, subset=False)


@pytest.mark.slow
def test_a_build_is_scored_until_its_verdict_is_known(own_root):
    """For real, on one task of 300 documents in rounds of 50: the baseline scores them all; int8, whose next
    verse recovers far above a threshold of 0.5, stops at the first look that decides it, on the baseline's first
    documents in the gate's order; the gate passes it on those and says how many of how many."""
    from memory_tracker import MemoryTracker

    from pipelines.core.card.cards import load_card
    from pipelines.decision.gate import decide
    from pipelines.present.report_tables import documents_section
    from pipelines.stages.evaluate import evaluate

    card_file = own_root / "cards" / "ref-small.yaml"
    text = card_file.read_text().replace("limit: 6", "limit: 300")
    text = text.replace("precisions: [bf16, fp8, int8, awq, gptq, int8+kv-fp8]", "precisions: [bf16, int8]")
    head = text[: text.index("  tasks: [")] + "  tasks: [refkjv_next_verse]\n" + text[text.index("  include_path") :]
    card_file.write_text(
        head[: head.index("gate:")]
        + "gate:\n  baseline: bf16\n  min_recovery: 0.5\n  min_speedup: null\n  stop_scoring: fail\n"
        + "  look_every: 50\n"
    )
    card, tracker = load_card("ref-small"), MemoryTracker("ref-small")
    base = evaluate(card, "bf16", tracker).result.accuracy
    assert base.rounds["refkjv_next_verse"] == TaskRounds(scored=300, pool=2798, why="budget spent")
    done = evaluate(card, "int8", tracker).result.accuracy
    took = done.rounds["refkjv_next_verse"]
    assert took.why == "decided" and took.scored < 300 and took.scored % 50 == 0
    folder = own_root / "artifacts/ref-small/int8/evaluate"
    ids = [json.loads(line)["doc_id"] for line in (folder / "samples_refkjv_next_verse.jsonl").open()]
    assert ids == document_order(2798, 0)[: took.scored]
    assert done.n_samples["refkjv_next_verse"] == took.scored

    decision = decide(card)
    (b,) = decision.builds
    c = b.tasks["refkjv_next_verse"]
    assert b.verdict == Verdict.PASS and (c.n, c.pool) == (took.scored, 300)
    assert f"| int8 | refkjv_next_verse | PASS | {took.scored:,} of 300, decided |" in "\n".join(
        documents_section(decision)
    )
