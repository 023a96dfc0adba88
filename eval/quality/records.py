"""lm-eval's results as qeval reads them: its scores normalised, and its per-document records read back.

eval/quality/accuracy.py runs lm-eval and writes what it returns; this module reads what lm-eval wrote (result keys
like `acc,none`, "N/A" stderrs, `samples_<task>.jsonl`), and nothing else in qeval does. document_metrics()
and documents() read the per-document records back, pooling a group's subtasks, for paired statistics.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field


class Metric(BaseModel):
    """One aggregate lm-eval reports for a task: a metric under a filter, with its stderr."""

    name: str = Field(description="lm-eval's metric name: acc, acc_norm, bits_per_byte, exact_match ...")
    filter: str = Field("none", description="lm-eval's filter; `none` for most tasks, gsm8k's strict-match")
    value: float
    stderr: float | None = Field(None, description="None where lm-eval gives none ('N/A')")
    higher_is_better: bool = True

    @property
    def id(self) -> str:
        """The metric's name, with its filter where that is not `none`: `acc`, `exact_match/strict-match`."""
        return self.name if self.filter == "none" else f"{self.name}/{self.filter}"


class TaskRounds(BaseModel):
    """How far a task scored in rounds went (eval/quality/rounds.py), and why it stopped there."""

    scored: int = Field(description="documents scored: the first of the gate's order")
    pool: int = Field(description="documents the task has")
    why: Literal["decided", "pool spent", "budget spent"]


class AccuracyResult(BaseModel):
    """lm-eval's scores, normalised, plus what is needed to reproduce and trust them."""

    scores: dict[str, list[Metric]] = Field(description="per task (and group), every numeric metric reported")
    groups: dict[str, list[str]] = Field({}, description="a group's subtasks, as lm-eval nests them")
    n_samples: dict[str, int] = Field(description="documents evaluated per task")
    versions: dict[str, Any] = Field(description="task versions as lm-eval reports them")
    chance: dict[str, float | None] = Field(description="chance level per task (task metadata `chance`)")
    datasets: dict[str, dict[str, Any]] = Field(description="per task: data source and sha256 of local files")
    backend: str = Field(description="lm-eval model backend used")
    lm_eval_version: str
    seconds: float
    peak_rss_mb: float = Field(description="peak resident memory of the evaluating process")
    not_scored: dict[str, str] = Field({}, description="tasks left unscored, with why (eval/quality/stopping.py)")
    rounds: dict[str, TaskRounds] = Field({}, description="tasks scored in rounds: how far, and why they stopped")

    def stopped(self) -> str:
        """Each task scored in rounds: why it stopped, after how many of its documents ("" for none)."""
        return "; ".join(f"{t}: {r.why} after {r.scored:,} of {r.pool:,}" for t, r in self.rounds.items())

    def values(self) -> dict[str, dict[str, float]]:
        """task -> metric id -> value."""
        return {t: {m.id: m.value for m in ms} for t, ms in self.scores.items()}

    def higher_is_better(self) -> dict[str, dict[str, bool]]:
        """task -> metric id -> whether higher is better."""
        return {t: {m.id: m.higher_is_better for m in ms} for t, ms in self.scores.items()}


GENERATED_IDS = "generated_ids"
"""The per-document record's field (generative tasks) holding the generated text's token ids."""


def generated(folder: Path, result: AccuracyResult, task: str) -> dict[tuple[str, Any], list[int]]:
    """(task, doc_id) -> the generated token ids of a generative task (a group's pooled); empty where the
    task does not generate or its records predate them."""
    out: dict[tuple[str, Any], list[int]] = {}
    for leaf, row in _records(folder, result, task):
        if GENERATED_IDS in row:
            out.setdefault((leaf, row["doc_id"]), row[GENERATED_IDS])
    return out


RESULTS_FILE = "lm_eval_results.json"
"""lm-eval's own result document in an evaluation's folder (eval/quality/accuracy.py writes it)."""


def answers(folder: Path, result: AccuracyResult, task: str, normalised: bool) -> dict[tuple[str, Any], int]:
    """(task, doc_id) -> the choice a multiple-choice task's model picked, as lm-eval picks it: the highest
    log-likelihood (`acc`), or with `normalised` the highest per character of the choice (`acc_norm`); empty
    where the task is not multiple-choice. A record's arguments hold each choice after the task's
    target_delimiter, which lm-eval's per-character norm leaves out."""
    delimiters = _delimiters(folder)
    out: dict[tuple[str, Any], int] = {}
    for leaf, row in _records(folder, result, task):
        resps, args = row.get("filtered_resps"), row.get("arguments")
        if not _choice_loglikelihoods(resps) or not args or len(args) != len(resps):
            return {}
        lls = [float(r[0]) for r in resps]
        if normalised:
            cut = len(delimiters.get(leaf, " "))
            lls = [ll / max(1, len(a[1]) - cut) for ll, a in zip(lls, args, strict=True)]
        out.setdefault((leaf, row["doc_id"]), max(range(len(lls)), key=lls.__getitem__))
    return out


def _choice_loglikelihoods(resps: Any) -> bool:
    """A multiple-choice record's filtered responses: one [log-likelihood, is-greedy] pair per choice."""
    return isinstance(resps, list) and len(resps) > 1 and all(isinstance(r, list) and len(r) == 2 for r in resps)


def _delimiters(folder: Path) -> dict[str, str]:
    """Per task, the target_delimiter lm-eval joined context and choice with (its configs)."""
    path = folder / RESULTS_FILE
    if not path.is_file():
        return {}
    configs = json.loads(path.read_text()).get("configs", {})
    return {t: c.get("target_delimiter", " ") for t, c in configs.items()}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def scores(results: dict[str, dict[str, Any]], higher_is_better: dict[str, dict[str, bool]]) -> dict[str, list[Metric]]:
    """lm-eval's `results` section (keys `metric,filter`, stderrs as `metric_stderr,filter`) as Metrics."""
    out: dict[str, list[Metric]] = {}
    for task, values in results.items():
        metrics = []
        for key, value in values.items():
            name, sep, filt = key.partition(",")
            if not sep or name.endswith("_stderr") or _number(value) is None:
                continue  # `alias`, `samples`, stderrs (taken with their metric), text
            metrics.append(
                Metric(
                    name=name,
                    filter=filt or "none",
                    value=_number(value),
                    stderr=_number(values.get(f"{name}_stderr,{filt}")),
                    higher_is_better=(higher_is_better.get(task) or {}).get(name, True),
                )
            )
        out[task] = metrics
    return out


def leaves(task: str, groups: dict[str, list[str]]) -> list[str]:
    """The tasks with per-document records under `task`: itself, or a group's subtasks, recursively."""
    if task not in groups:
        return [task]
    return [leaf for sub in groups[task] for leaf in leaves(sub, groups)]


def _samples(folder: Path, task: str) -> Path:
    path = folder / f"samples_{task}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no per-document records {path}")
    return path


def document_metrics(folder: Path, result: AccuracyResult, task: str) -> list[Metric]:
    """The task's reported metrics that also have per-document values (a group: those of its first leaf)."""
    first = leaves(task, result.groups)[0]
    with _samples(folder, first).open() as f:
        row = json.loads(f.readline())
    reported = result.scores.get(task) or result.scores.get(first) or []
    return [m for m in reported if m.name in row]


def documents(folder: Path, result: AccuracyResult, task: str, metric: Metric) -> dict[tuple[str, Any], Any]:
    """(task, doc_id) -> the metric's per-document value: a score, or [log-likelihood, length] for
    perplexity-type metrics. A group's documents are pooled, which weighs each subtask by its size as
    lm-eval's groups do."""
    out = {}
    for leaf, row in _records(folder, result, task):
        if row.get("filter", metric.filter) == metric.filter and metric.name in row:
            value = row[metric.name]
            out[(leaf, row["doc_id"])] = tuple(value) if isinstance(value, list) else value
    return out


def _records(folder: Path, result: AccuracyResult, task: str) -> Iterator[tuple[str, dict]]:
    """(leaf task, per-document record) for `task`, a group's subtasks in turn."""
    for leaf in leaves(task, result.groups):
        with _samples(folder, leaf).open() as f:
            for line in f:
                yield leaf, json.loads(line)
