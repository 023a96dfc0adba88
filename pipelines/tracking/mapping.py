"""The pure functions that turn typed results into MLflow names: what a stage's result logs to its build's
run (by the tables of tables.py), and the gate's verdicts, tags and policy.

No MLflow import: pipelines/tracking/mlflow_tracker.py writes what these return to the store, and
tests/memory_tracker.py keeps the same in memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from eval.quality.stats import Verdict
from pipelines.core.store.manifests import CodeVersion
from pipelines.core.store.ranked import Ranked
from pipelines.core.store.results import AtShape, Benched, Evaluated, Quantized, Served, Sized, StageResult
from pipelines.core.store.verdicts import BuildVerdict, Decision, Measured
from pipelines.present import formats
from pipelines.tracking.names import (
    EVAL_DOCUMENTS,
    EVAL_METRIC,
    EVAL_STDERR,
    GATE_PARAM,
    MAX_TAG,
    RECOVERY_METRIC,
    SERVED_DIFF,
    SERVED_METRIC,
    SIZE_GPU_METRIC,
    TAG_CHOSEN,
    TAG_COMMIT,
    TAG_DESCRIPTION,
    TAG_DIGESTS,
    TAG_DIRTY,
    TAG_MODEL,
    TAG_NOT_RUN,
    TAG_PRECISION,
    TAG_REASONS,
    TAG_RUN_COLOUR,
    TAG_SHIPS,
    TAG_STAGE,
    TAG_VERDICT,
)
from pipelines.tracking.tables import (
    BENCH_METRICS,
    BENCH_PARAMS,
    BENCH_SERIES,
    ENGINE_SETTINGS,
    EVAL_PARAMS,
    EVAL_SETTINGS,
    GATE_FLIPS,
    GATE_GENERATION,
    GATE_METRICS,
    GATE_TASK,
    LOAD_SETTINGS,
    QUANTIZE_METRICS,
    QUANTIZE_PARAMS,
    QUANTIZE_SETTINGS,
    SENSITIVITY_METRICS,
    SENSITIVITY_PARAMS,
    SERVE_METRICS,
    SERVE_PARAMS,
    SERVE_SERIES,
    SHAPE_LOAD_SETTINGS,
    SHAPE_METRICS,
    SHAPE_PARAMS,
    SHAPE_SCENARIO,
    SHAPE_SCENARIO_METRICS,
    SHAPE_SCENARIO_PARAMS,
    SHAPE_SERIES,
    SHAPE_VLLM_SETTINGS,
    SIZE_GPU_FIGURES,
    SIZE_METRICS,
    SIZE_PARAMS,
    VERIFY_SETTINGS,
    VLLM_SETTINGS,
    Getter,
)


@dataclass
class Logged:
    """What one stage writes to its build's run."""

    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Metrics over a step (batch size, concurrency): name -> [(step, value), ...]."""
    params: dict[str, str] = field(default_factory=dict)
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _numbers(table: Mapping[str, Getter], obj: Any) -> dict[str, float]:
    values = {name: get(obj) for name, get in table.items()}
    return {k: float(v) for k, v in values.items() if v is not None and not isinstance(v, str)}


def _params(table: Mapping[str, Getter], obj: Any) -> dict[str, str]:
    values = {name: get(obj) for name, get in table.items()}
    return {k: _text(v) for k, v in values.items() if v is not None}


def _settings(config: Any, table: Mapping[str, str]) -> dict[str, str]:
    return {param: _text(getattr(config, name)) for name, param in table.items()} if config is not None else {}


def _finite(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if math.isfinite(v)}


def _quantized(result: Quantized) -> Logged:
    params = _settings(result.config, QUANTIZE_SETTINGS) | _settings(result.verify, VERIFY_SETTINGS)
    return Logged(_numbers(QUANTIZE_METRICS, result), params=params | _params(QUANTIZE_PARAMS, result))


def _evaluated(result: Evaluated) -> Logged:
    metrics = {}
    for task, scores in result.accuracy.scores.items():
        for m in scores:
            metrics[EVAL_METRIC.format(task=task, metric=m.id)] = m.value
            if m.stderr is not None:
                suffix = "" if m.filter == "none" else f"/{m.filter}"
                metrics[EVAL_STDERR.format(task=task, name=m.name, filter=suffix)] = m.stderr
    for task, values in (result.recovery or {}).items():
        metrics |= {RECOVERY_METRIC.format(task=task, metric=k): v for k, v in values.items()}
    metrics |= {EVAL_DOCUMENTS.format(task=task): n for task, n in result.accuracy.n_samples.items()}
    params = _settings(result.config, EVAL_SETTINGS) | _params(EVAL_PARAMS, result)
    return Logged(_finite(metrics), params=params, datasets=result.accuracy.datasets)


def _benched(result: Benched) -> Logged:
    points = result.main_points()
    series = {n: [(p.batch, v) for p in points if (v := get(p)) is not None] for n, get in BENCH_SERIES.items()}
    params = _settings(result.config, ENGINE_SETTINGS) | _params(BENCH_PARAMS, result)
    return Logged(_numbers(BENCH_METRICS, result), series, params)


def _at_shape(result: AtShape) -> Logged:
    """Random weights' figures, under shape/*, per scenario under shape/<scenario>/."""
    metrics, series = _numbers(SHAPE_METRICS, result), {}
    params = _settings(result.vllm, SHAPE_VLLM_SETTINGS) | _params(SHAPE_PARAMS, result)
    for name, sweep in result.scenarios.items():
        prefix = SHAPE_SCENARIO.format(scenario=name)
        metrics |= {prefix + k: v for k, v in _numbers(SHAPE_SCENARIO_METRICS, sweep).items()}
        levels = sweep.per_level.items()
        series |= {
            prefix + n: [(c, float(v)) for c, m in levels if (v := get(m)) is not None]
            for n, get in SHAPE_SERIES.items()
        }
        each = _settings(sweep.load, SHAPE_LOAD_SETTINGS) | _params(SHAPE_SCENARIO_PARAMS, sweep)
        params |= {k.format(scenario=name): v for k, v in each.items()}
    return Logged(_finite(metrics), series, params)


def _served_stage(result: Served) -> Logged:
    levels = result.per_level.items()
    series = {n: [(c, float(v)) for c, m in levels if (v := get(m)) is not None] for n, get in SERVE_SERIES.items()}
    params = _settings(result.load, LOAD_SETTINGS) | _settings(result.vllm, VLLM_SETTINGS)
    return Logged(
        _numbers(SERVE_METRICS, result) | _served(result),
        series,
        params | _params(SERVE_PARAMS, result),
        tags={TAG_NOT_RUN.format(stage=Served.STAGE): result.not_run[:MAX_TAG]} if result.not_run else {},
    )


def _sized(result: Sized) -> Logged:
    metrics = _numbers(SIZE_METRICS, result)
    for f in result.fits:
        metrics |= {SIZE_GPU_METRIC.format(gpu=f.gpu, figure=k): float(get(f)) for k, get in SIZE_GPU_FIGURES.items()}
    return Logged(metrics, params=_params(SIZE_PARAMS, result))


def _ranked(result: Ranked) -> Logged:
    series = {
        "sensitivity/kl_by_rank": [(i, g.kl) for i, g in enumerate(result.ranked)],
        "search/predicted_kl": [(c.kept, c.predicted_kl) for c in result.frontier],
        "search/projected_weights_gb": [(c.kept, c.weight_bytes / 1e9) for c in result.frontier],
    }
    return Logged(_numbers(SENSITIVITY_METRICS, result), series, _params(SENSITIVITY_PARAMS, result))


MAPPINGS: dict[type[StageResult], Callable[[Any], Logged]] = {
    Ranked: _ranked,
    Quantized: _quantized,
    Evaluated: _evaluated,
    Benched: _benched,
    AtShape: _at_shape,
    Served: _served_stage,
    Sized: _sized,
}
"""How each stage's result type logs to its build's run: a stage whose result has no entry here fails
tests/test_tracking.py (every result type the stage registry names must have one)."""


def logged(result: StageResult) -> Logged:
    """The metrics, series, params and data sets a stage's result logs to its build's run."""
    mapping = MAPPINGS.get(type(result))
    if mapping is None:
        raise TypeError(f"no MLflow mapping for {type(result).__name__}: add one to MAPPINGS")
    return mapping(result)


def _served(result: Served) -> dict[str, float]:
    """The build's scores through its server, and their paired difference from the offline ones."""
    if result.accuracy is None:
        return {}
    metrics = {
        SERVED_METRIC.format(task=task, metric=m.id): m.value
        for task, scores in result.accuracy.accuracy.scores.items()
        for m in scores
    }
    for task, c in result.accuracy.vs_offline.items():
        for bound, value in zip(("", "_lower", "_upper"), c.difference, strict=True):
            metrics[SERVED_DIFF.format(task=task, metric=c.metric, bound=bound)] = value
    return _finite(metrics)


def verdict_metrics(build: BuildVerdict) -> dict[str, float]:
    """A build's headline figures under the gate (`gate/*`), for the runs table: four significant digits,
    which is what a table cell shows whole (gate.json and the `eval/*` metrics keep every digit)."""
    figures = _numbers(GATE_METRICS, build) | generation_metrics(build)
    return {k: float(f"{v:.4g}") for k, v in _finite(figures).items()}


def generation_metrics(build: BuildVerdict) -> dict[str, float]:
    """Per generative task (`gate/<task>/*`): output length over the baseline's with its interval, where
    greedy outputs depart from the baseline's, and the share that never do; per multiple-choice task, the share
    of answers that differ from the baseline's, with its interval."""
    out: dict[str, float] = {}
    for task, g in build.generation.items():
        out |= {GATE_TASK.format(task=task) + k: v for k, v in _numbers(GATE_GENERATION, g).items()}
    for task, f in build.flips.items():
        out |= {GATE_TASK.format(task=task) + k: v for k, v in _numbers(GATE_FLIPS, f).items()}
    return out


def baseline_metrics(baseline: Measured) -> dict[str, float]:
    """The baseline's `gate/*` figures: recovery and speed-up 1 by definition."""
    build = BuildVerdict(precision="", verdict=Verdict.BASELINE, rules=[], tasks={}, speed=baseline, speedup=1.0)
    return verdict_metrics(build)


def verdict_tags(decision: Decision, build: BuildVerdict | None) -> dict[str, str]:
    """A build's verdict, its reasons (one per line) and its one-line summary as the run's description
    (None: the baseline); register_ship marks the chosen."""
    precision = build.precision if build else decision.policy.baseline  # the colour too, for runs made before it
    note = {TAG_DESCRIPTION: formats.summary(decision, build), TAG_RUN_COLOUR: formats.precision_colour(precision)}
    if build is None:
        return {TAG_VERDICT: str(Verdict.BASELINE), TAG_REASONS: "the baseline every build is compared with", **note}
    reasons = "\n".join(build.reasons)[:MAX_TAG]
    return {TAG_VERDICT: str(build.verdict), TAG_REASONS: reasons, TAG_CHOSEN: "false", **note}


def summary_tags(decision: Decision) -> dict[str, str]:
    ships = f"Ships {decision.chosen}: {decision.why}." if decision.chosen else f"Nothing ships: {decision.why}."
    return {TAG_SHIPS: decision.chosen or "none", TAG_DESCRIPTION: ships, **code_tags(decision.code)}


def decision_params(decision: Decision) -> dict[str, str]:
    """The policy the decision was made under, one `gate.<key>` param per policy key."""
    values = decision.policy.model_dump()
    return {
        GATE_PARAM.format(key=k): json.dumps(v) if isinstance(v, dict | list) else str(v) for k, v in values.items()
    }


def code_tags(code: CodeVersion) -> dict[str, str]:
    return {TAG_COMMIT: code.commit, TAG_DIRTY: str(code.dirty).lower()}


def stage_tags(stage: str, digest: str, code: CodeVersion, digests: str | None = None) -> dict[str, str]:
    """A finished stage's tags; `digests`: the run's TAG_DIGESTS so far, to which this stage's is added."""
    known = {**json.loads(digests or "{}"), stage: digest}
    return {TAG_STAGE.format(stage=stage): "done", TAG_DIGESTS: json.dumps(known, sort_keys=True), **code_tags(code)}


def stage_digest(tags: Mapping[str, str], stage: str) -> str | None:
    """The cache key a run's tags record for a finished stage."""
    return json.loads(tags.get(TAG_DIGESTS) or "{}").get(stage)


def build_run_tags(model: str, precision: str) -> dict[str, str]:
    return {TAG_MODEL: model, TAG_PRECISION: precision, TAG_RUN_COLOUR: formats.precision_colour(precision)}
