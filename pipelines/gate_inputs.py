"""What the gate reads of the stages: per-document samples of evaluate, bench and serve manifests.

Turns them into the paired task comparisons (eval/stats.py) and the speed and memory figures the
policy in pipelines/gate.py judges. Every missing or mismatched input is one error naming the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.stats import Comparison, compare, is_likelihood
from pipelines.cards import Gate, ModelCard
from pipelines.errors import QevalError
from pipelines.stages import read_manifest, stage_dir

METRIC_PREFERENCE = ("bits_per_byte", "acc_norm", "acc", "exact_match")


@dataclass(frozen=True)
class Measured:
    """What the gate needs of one build's speed and memory measurements."""

    decode_tps: float  # engine: tokens/s per user at the policy's batch
    peak_gb: float  # engine: peak memory at the policy's batch
    weights_gb: float
    kernels: str
    regime: str = "engine"
    engine: str = ""  # engine: how generate() ran (cache, compiled or eager)
    goodput: float | None = None  # server: requests/s that met the SLO at the policy's users
    users_at_slo: int | None = None  # server: the most concurrent users that met the SLO

    @property
    def speed(self) -> float:
        """The figure the speed rule and the choice use, by the policy's regime."""
        return (self.goodput or 0.0) if self.regime == "server" else self.decode_tps


def task_threshold(policy: Gate, task: str, likelihood: bool) -> tuple[str, float]:
    """(rule, threshold) for a task: a perplexity bound where the policy sets one and the metric allows it."""
    if likelihood and policy.max_ppl_increase is not None and task not in policy.task_min_recovery:
        return "ppl_increase", policy.max_ppl_increase
    return "recovery", policy.task_min_recovery.get(task, policy.min_recovery)


def finished(card: ModelCard, precision: str, stage: str) -> dict:
    done = read_manifest(stage_dir(card.name, precision, stage))
    if not done or done.get("status") != "done":
        raise QevalError(
            f"gate: {card.name}@{precision} has no finished {stage} stage; run: qeval "
            f"{'serve-bench' if stage == 'serve' else stage} --model {card.name}"
            + (f" --precision {precision}" if precision != card.gate.baseline or stage == "bench" else "")
        )
    return done


def _at(series: list, batch: int, name: str, where: str) -> float:
    values = {int(b): float(v) for b, v in series}
    if batch not in values:
        raise QevalError(f"gate: {where} has no {name} at batch {batch} (out of memory there, or another grid)")
    return values[batch]


def measured(card: ModelCard, precision: str) -> tuple[Measured, float]:
    """The build's speed and memory at the policy's batch, and its weight bytes."""
    done = finished(card, precision, "bench")
    where = f"{card.name}@{precision} bench"
    if done["inputs"]["config"].get("no_weights"):
        raise QevalError(f"gate: {where} used random weights (--no-weights); bench the checkpoint: qeval bench")
    b = card.gate.speed_batch
    m = Measured(
        decode_tps=_at(done["series"].get("engine/decode_tps", []), b, "decode speed", where),
        peak_gb=_at(done["series"].get("mem/peak_gb", []), b, "peak memory", where),
        weights_gb=float(done["metrics"]["mem/weights_gb"]),
        kernels=done["params"].get("engine.kernels", "unknown"),
        regime=card.gate.speed_regime,
        engine=done["params"].get("engine.engine", ""),
        **_server(card, precision),
    )
    return m, float(done["summary"]["weight_bytes"])


def judged_users(card: ModelCard) -> int:
    return card.gate.speed_users or max(card.speed.concurrency)


def _server(card: ModelCard, precision: str) -> dict[str, Any]:
    """Goodput at the judged concurrency and users at the SLO, from the serve stage (required by the
    server regime, shown where it exists otherwise)."""
    if card.gate.speed_regime == "server":
        done = finished(card, precision, "serve")
    else:
        done = read_manifest(stage_dir(card.name, precision, "serve"))
        if not done or done.get("status") != "done":
            return {}
    users = judged_users(card)
    level = done["summary"]["per_level"].get(str(users))
    if level is None:
        raise QevalError(f"gate: {card.name}@{precision} serve has no level at {users} users; rerun qeval serve-bench")
    return {"goodput": float(level.get("goodput", 0.0)), "users_at_slo": int(done["summary"]["max_users_at_slo"])}


def gating_metric(card: ModelCard, task: str, results: dict[str, Any], row: dict[str, Any]) -> tuple[str, str]:
    """(metric, filter) that gates `task`: the card's choice, else the first of METRIC_PREFERENCE present.

    The filter is `none` where lm-eval reports one, else the first it reports (gsm8k: strict-match).
    """
    reported: dict[str, list[str]] = {}
    for key in results:
        metric, _, filt = key.partition(",")
        if filt and not metric.endswith("_stderr") and metric in row:
            reported.setdefault(metric, []).append(filt)
    chosen = card.gate.task_metric.get(task)
    if chosen:
        metric, _, filt = chosen.partition(",")
        if metric not in reported:
            raise QevalError(
                f"gate.task_metric: task '{task}' has no per-document '{metric}'; it has: {sorted(reported)}"
            )
        return metric, filt or ("none" if "none" in reported[metric] else reported[metric][0])
    if not reported:
        raise QevalError(f"gate: task '{task}' has no per-document metric to compare")
    metric = next((m for m in METRIC_PREFERENCE if m in reported), next(iter(reported)))
    return metric, "none" if "none" in reported[metric] else reported[metric][0]


def leaves(task: str, groups: dict[str, list[str]]) -> list[str]:
    """The tasks with per-document records under `task`: itself, or a group's subtasks, recursively."""
    if task not in groups:
        return [task]
    return [leaf for sub in groups[task] for leaf in leaves(sub, groups)]


def per_document(folder: Path, tasks: list[str], metric: str, filt: str) -> dict[tuple[str, Any], Any]:
    """(task, doc_id) -> the metric's per-document value, from lm-eval's logged samples.

    A group's documents are pooled, which weighs each subtask by its size as lm-eval's groups do.
    """
    out = {}
    for task in tasks:
        path = folder / f"samples_{task}.jsonl"
        if not path.is_file():
            raise QevalError(f"gate: no per-document records {path}; rerun: qeval evaluate --force")
        with path.open() as f:
            for line in f:
                row = json.loads(line)
                if row.get("filter", filt) == filt and metric in row:
                    out[(task, row["doc_id"])] = row[metric]
    return out


def _first_row(folder: Path, task: str) -> dict[str, Any]:
    with (folder / f"samples_{task}.jsonl").open() as f:
        return json.loads(f.readline())


def _groups(folder: Path) -> dict[str, list[str]]:
    try:
        return json.loads((folder / "lm_eval_results.json").read_text()).get("group_subtasks") or {}
    except (OSError, ValueError):
        return {}


def task_comparisons(card: ModelCard, precision: str, base_eval: dict, build_eval: dict) -> dict[str, Comparison]:
    """The paired comparison of every task of the card between the build and the baseline."""
    base_dir = stage_dir(card.name, card.gate.baseline, "evaluate")
    build_dir = stage_dir(card.name, precision, "evaluate")
    if build_eval["inputs"]["config"] != base_eval["inputs"]["config"]:
        raise QevalError(
            f"gate: {card.name}@{precision} was evaluated with other settings than the baseline; rerun both "
            f"with the card's settings: qeval run --model {card.name}"
        )
    groups = _groups(base_dir)
    out = {}
    for task in card.accuracy.tasks:
        subtasks = leaves(task, groups)
        results = base_eval["summary"]["results"].get(task) or base_eval["summary"]["results"][subtasks[0]]
        metric, filt = gating_metric(card, task, results, _first_row(base_dir, subtasks[0]))
        base = per_document(base_dir, subtasks, metric, filt)
        build = per_document(build_dir, subtasks, metric, filt)
        if base.keys() != build.keys() or not base:
            raise QevalError(f"gate: {card.name}@{precision} {task}: not the baseline's documents; rerun evaluate")
        docs = sorted(base, key=str)
        base_v, build_v = [base[d] for d in docs], [build[d] for d in docs]
        hib_all = base_eval["summary"]["higher_is_better"]
        hib = (hib_all.get(task) or hib_all.get(subtasks[0]) or {}).get(metric, True)
        rule, threshold = task_threshold(card.gate, task, is_likelihood(base_v))
        out[task] = compare(
            metric, base_v, build_v, higher_is_better=hib, rule=rule, threshold=threshold,
            confidence=card.gate.confidence,
        )  # fmt: skip
    return out
