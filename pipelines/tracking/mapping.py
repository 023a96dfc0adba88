"""The pure functions that turn typed results into MLflow names: what a stage's result logs to its build's
run (as its type declares it, its `LOGS`), and the gate's verdicts, tags and policy (by the tables of tables.py).

No MLflow import: pipelines/tracking/mlflow_tracker.py writes what these return to the store, and
tests/memory_tracker.py keeps the same in memory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from eval.quality.stats import Verdict
from pipelines.core.store import formats
from pipelines.core.store.manifests import CodeVersion
from pipelines.core.store.results import StageResult
from pipelines.core.store.results.logs import Logged, Logs, finite, numbers, settings, texts
from pipelines.core.store.verdicts import BuildVerdict, Decision, Measured
from pipelines.tracking.names import (
    GATE_PARAM,
    MAX_TAG,
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
from pipelines.tracking.tables import GATE_FLIPS, GATE_GENERATION, GATE_METRICS, GATE_TASK


def logged(result: StageResult) -> Logged:
    """The metrics, series, params, data sets and tags a stage's result logs to its build's run, as its type
    declares them (its `LOGS`, pipelines/core/store/results/logs.py)."""
    logs: Logs | None = getattr(type(result), "LOGS", None)
    if logs is None:
        raise TypeError(f"no MLflow declaration for {type(result).__name__}: give it LOGS (a Logs) beside its fields")
    params = {}
    for s in logs.settings:
        params |= settings(s.config(result), s.params)
    series = {}
    if logs.points is not None:
        points = list(logs.points(result))
        series = {
            name: [(step, float(v)) for step, point in points if (v := get(point)) is not None]
            for name, get in logs.series.items()
        }
    out = Logged(finite(numbers(logs.metrics, result)), series, params | texts(logs.params, result))
    if logs.more is not None:
        out = out.update(logs.more(result))
    if logs.not_run is not None and (why := logs.not_run(result)):
        out.tags[TAG_NOT_RUN.format(stage=result.STAGE)] = why[:MAX_TAG]
    return out


def verdict_metrics(build: BuildVerdict) -> dict[str, float]:
    """A build's headline figures under the gate (`gate/*`), for the runs table: four significant digits,
    which is what a table cell shows whole (gate.json and the `eval/*` metrics keep every digit)."""
    figures = numbers(GATE_METRICS, build) | generation_metrics(build)
    return {k: float(f"{v:.4g}") for k, v in finite(figures).items()}


def generation_metrics(build: BuildVerdict) -> dict[str, float]:
    """Per generative task (`gate/<task>/*`): output length over the baseline's with its interval, where
    greedy outputs depart from the baseline's, and the share that never do; per multiple-choice task, the share
    of answers that differ from the baseline's, with its interval."""
    out: dict[str, float] = {}
    for task, g in build.generation.items():
        out |= {GATE_TASK.format(task=task) + k: v for k, v in numbers(GATE_GENERATION, g).items()}
    for task, f in build.flips.items():
        out |= {GATE_TASK.format(task=task) + k: v for k, v in numbers(GATE_FLIPS, f).items()}
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
