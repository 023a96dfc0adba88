"""A task scored in rounds: its documents in the gate's seeded order (eval/quality/sequential.py,
`scoring_order`), `every` at a time on one loaded model, until its verdict is known, its pool is spent or the card's
budget (`accuracy.limit`) is.

Each round is one lm-eval run over that round's documents (`simple_evaluate`'s `samples`), the same rounds for the
baseline and every build, so a document is scored in the same batch everywhere (bf16 rounds each batch's sums its
own way). A task's records go to samples_<task>.jsonl round by round, and its scores are aggregated from all of
its rounds' records by lm-eval's own aggregation (each metric's aggregation and stderr), as one run over those
documents would. A task judged by its gain over a control is scored with it, on the same documents in the same
rounds.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from eval.quality.records import TaskRounds
from eval.quality.sequential import scoring_order


class Rounds(BaseModel):
    """How a card's tasks are scored in rounds: the gate's looks and its order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every: PositiveInt = Field(description="documents per round: the gate's look_every, a look at each round's end")
    seed: int = Field(description="the scoring order's seed: the gate's, which orders the documents it judges")
    controls: dict[str, str] = Field({}, description="task -> its control, scored on its documents in its rounds")


def document_order(pool: int, seed: int) -> list[int]:
    """A task's document indices in the order the gate reads them."""
    return scoring_order(list(range(pool)), seed)


def score_in_rounds(
    lm: Any,
    unit: list[str],
    tasks: dict[str, list],
    rounds: Rounds,
    budget: int | None,
    run: Callable[..., dict],
    out_dir: Path,
    decided: Callable[[dict], bool] | None,
    bootstrap_iters: int,
) -> tuple[dict, dict[str, TaskRounds]]:
    """Score `unit` (a task, and its control where it has one) round by round; after each, `decided` (given the
    result document so far) says whether the task's verdict is known (None: score the whole budget, as the
    baseline does). `run(lm, task_objects, samples)` is one lm-eval run with the samples kept. Returns the
    unit's result document, aggregated over every round, and how far each task was scored."""
    first = tasks[unit[0]][0]
    pool = len(first.eval_docs)
    for name in unit[1:]:
        if len(tasks[name][0].eval_docs) != pool:
            raise ValueError(f"{name}, the control of {unit[0]}, has other documents: it must have the same items")
    end = min(pool, budget or pool)
    order = document_order(pool, rounds.seed)[:end]
    rows: dict[str, list[dict]] = {name: [] for name in unit}
    last: dict[str, dict] = {}
    for name in unit:
        (out_dir / f"samples_{name}.jsonl").write_text("")
    why, scored = ("pool spent" if end == pool else "budget spent"), 0
    for start in range(0, end, rounds.every):
        chunk = order[start : start + rounds.every]
        for name in unit:
            out = run(lm, tasks[name], {name: chunk})
            new = out.pop("samples")[name]
            with (out_dir / f"samples_{name}.jsonl").open("a") as f:
                f.writelines(json.dumps(row, default=str) + "\n" for row in new)
            rows[name] += new
            last[name] = out
        scored += len(chunk)
        if decided is not None and decided(_aggregated(tasks, rows, last, 0)):
            why = "decided"
            break
    took = {name: TaskRounds(scored=scored, pool=pool, why=why) for name in unit}
    return _aggregated(tasks, rows, last, bootstrap_iters), took


def _aggregated(tasks: dict[str, list], rows: dict[str, list[dict]], last: dict[str, dict], iters: int) -> dict:
    """The unit's result document over every record scored so far: the last round's, its tasks' sections made
    again from all the records by lm-eval's aggregation (lm_eval/evaluator_utils.py, `_process_results`, the
    step simple_evaluate ends with; `iters` bootstrap resamples for the stderrs, 0: none)."""
    from lm_eval.evaluator_utils import _process_results

    acc = {}
    for name, records in rows.items():
        raw: dict[tuple[str, str], list] = defaultdict(list)
        for row in records:
            for metric in row["metrics"]:
                raw[(metric, row["filter"])].append(row[metric])
        acc[name] = {"task": tasks[name][0], "raw_metrics": raw, "logged_samples": []}
    fresh = _process_results(acc, None, iters)._to_eval_results()
    out: dict = {}
    for doc in last.values():
        for key, value in doc.items():
            out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else out.get(key, value)
    for key, value in fresh.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out
