"""What the gate reads of the stages: their typed results, and the per-document records of evaluate.

Turns them into the paired task comparisons (eval/stats.py) and the speed and memory figures the
policy in pipelines/gate.py judges. Every missing or mismatched input is one error naming the fix.
"""

from __future__ import annotations

from pathlib import Path

from eval import accuracy
from eval.serving import LevelMetrics
from eval.sizing import Fit
from eval.stats import Comparison, compare, is_likelihood
from pipelines.cards import Gate, ModelCard
from pipelines.errors import QevalError
from pipelines.results import (
    PREFERRED_METRICS,
    Benched,
    Evaluated,
    Measured,
    Served,
    Sized,
    finished,
    require,
    stage_dir,
)


def task_threshold(policy: Gate, task: str, likelihood: bool) -> tuple[str, float]:
    """(rule, threshold) for a task: a perplexity bound where the policy sets one and the metric allows it."""
    if likelihood and policy.max_ppl_increase is not None and task not in policy.task_min_recovery:
        return "ppl_increase", policy.max_ppl_increase
    return "recovery", policy.task_min_recovery.get(task, policy.min_recovery)


def measured(card: ModelCard, precision: str) -> tuple[Measured, float]:
    """The build's speed and memory at the policy's batch, and its resident weight bytes."""
    bench = require(card, precision, Benched, "gate")
    where = f"gate: {card.name}@{precision} bench"
    if bench.config.no_weights:
        raise QevalError(f"{where} used random weights (--no-weights); bench the checkpoint: qeval bench")
    b = card.gate.speed_batch
    point = bench.at(b)
    if point is None or point.decode_tps_per_user is None or point.peak_mem_bytes is None:
        raise QevalError(f"{where} has no decode speed at batch {b} (out of memory there, or another grid)")
    served = _served(card, precision)
    server_regime = card.gate.speed_regime == "server"
    m = Measured(
        decode_tps=point.decode_tps_per_user,
        peak_gb=point.peak_mem_bytes / 1e9,
        weights_gb=bench.engine.weight_bytes / 1e9,
        # the regime's own: the server's kernels (vLLM's report) or the engine bench's
        kernels=f"{served.execution} ({served.engine})" if server_regime and served else bench.engine.kernels,
        regime=card.gate.speed_regime,
        engine=served.engine if server_regime and served else bench.engine.engine,
        goodput=_level(card, precision, served).goodput_rps if served else None,
        users_at_slo=served.max_users_at_slo if served else None,
    )
    return m, float(bench.engine.weight_bytes)


def _served(card: ModelCard, precision: str) -> Served | None:
    """The build's server sweep (required under the server regime, shown where it exists otherwise)."""
    if card.gate.speed_regime == "server":
        return require(card, precision, Served, "gate")
    done = finished(card.name, precision, Served)
    return done.result if done else None


def _level(card: ModelCard, precision: str, served: Served) -> LevelMetrics:
    level = served.per_level.get(card.judged_users)
    if level is None:
        raise QevalError(
            f"gate: {card.name}@{precision} serve has no level at {card.judged_users} users; rerun qeval serve-bench"
        )
    return level


def fits(card: ModelCard, precision: str) -> list[Fit]:
    """The sizing projection on each GPU the policy requires a fit on, from the size stage."""
    sized = require(card, precision, Sized, "gate")
    projected = {f.gpu: f for f in sized.fits}
    missing = [g for g in card.gate.must_fit if g not in projected]
    if missing or (sized.batch, sized.input_len, sized.output_len) != (
        card.speed.largest_batch,
        card.speed.input_len,
        card.speed.output_len,
    ):
        raise QevalError(f"gate: {card.name}@{precision} was sized for other GPUs or another grid; rerun: "
                         f"qeval size --log --model {card.name} --precision {precision}")  # fmt: skip
    return [projected[g] for g in card.gate.must_fit]


def gating_metric(card: ModelCard, task: str, available: list[accuracy.Metric]) -> accuracy.Metric:
    """The metric that gates `task`: the card's choice, else the first of PREFERRED_METRICS reported.

    A metric's filter is `none` where lm-eval reports one, else the first it reports (gsm8k: strict-match).
    """
    if not available:
        raise QevalError(f"gate: task '{task}' has no per-document metric to compare")
    by_name: dict[str, list[accuracy.Metric]] = {}
    for m in available:
        by_name.setdefault(m.name, []).append(m)
    chosen = card.gate.task_metric.get(task)
    name, _, filt = (chosen or "").replace("/", ",").partition(",")
    if chosen and name not in by_name:
        raise QevalError(f"gate.task_metric: task '{task}' has no per-document '{name}'; it has: {sorted(by_name)}")
    name = name or next((n for n in PREFERRED_METRICS if n in by_name), next(iter(by_name)))
    candidates = by_name[name]
    return next((m for m in candidates if m.filter == (filt or "none")), candidates[0])


Evaluation = tuple[Path, Evaluated]  # an evaluation's folder (per-document records) and result


def task_comparisons(card: ModelCard, precision: str) -> dict[str, Comparison]:
    """The paired comparison of every task of the card between the build and the baseline."""
    base = require(card, card.gate.baseline, Evaluated, "gate")
    folder = stage_dir(card.name, card.gate.baseline, Evaluated.STAGE)
    return paired_with(card, precision, (folder, base), "the baseline")


def paired_with(
    card: ModelCard, precision: str, other: Evaluation, who: str = "the shipped build"
) -> dict[str, Comparison]:
    """Every task of the card, the build against `other` (the baseline's or the shipped build's evaluation)."""
    build = require(card, precision, Evaluated, "gate")
    if build.settings != other[1].settings:
        raise QevalError(
            f"gate: {card.name}@{precision} was evaluated with other settings than {who}; rerun both "
            f"with the card's settings: qeval run --model {card.name}"
        )
    build_dir = stage_dir(card.name, precision, Evaluated.STAGE)
    out = {}
    for task in card.accuracy.tasks:
        try:
            out[task] = paired(card, task, (other[0], other[1].accuracy), (build_dir, build.accuracy))
        except FileNotFoundError as e:
            raise QevalError(f"gate: {e}; rerun: qeval evaluate --force") from None
        except KeyError:
            raise QevalError(f"gate: {card.name}@{precision} {task}: not {who}'s documents; rerun evaluate") from None
    return out


Scored = tuple[Path, accuracy.AccuracyResult]  # an evaluation's folder (per-document records) and result


def paired(card: ModelCard, task: str, base: Scored, build: Scored, *, subset: bool = False) -> Comparison:
    """One task's gating metric, `build` against `base` on the same documents, under the card's policy.

    `subset`: `build` scored the first documents of `base`'s set, and is compared on those. Raises
    FileNotFoundError where a per-document record is missing, KeyError where the two were not scored
    on the same documents.
    """
    metric = gating_metric(card, task, accuracy.document_metrics(base[0], base[1], task))
    base_docs = accuracy.documents(base[0], base[1], task, metric)
    build_docs = accuracy.documents(build[0], build[1], task, metric)
    if subset and build_docs.keys() <= base_docs.keys():
        base_docs = {d: base_docs[d] for d in build_docs}
    if base_docs.keys() != build_docs.keys() or not base_docs:
        raise KeyError(task)
    docs = sorted(base_docs, key=str)
    base_v, build_v = [base_docs[d] for d in docs], [build_docs[d] for d in docs]
    rule, threshold = task_threshold(card.gate, task, is_likelihood(base_v))
    return compare(
        metric.name, base_v, build_v, higher_is_better=metric.higher_is_better, rule=rule, threshold=threshold,
        confidence=card.gate.confidence, iters=card.gate.bootstrap_resamples, seed=card.gate.bootstrap_seed,
    )  # fmt: skip
