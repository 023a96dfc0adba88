"""Recovery of a build against its baseline: pure functions on numbers, unit-tested by hand."""

from __future__ import annotations

from collections.abc import Mapping

from eval.quality.stats import ratio


def recovery(build: float, baseline: float, higher_is_better: bool) -> float:
    """build / baseline, or baseline / build for lower-is-better metrics: 1.0 always means "as good"."""
    num, den = (build, baseline) if higher_is_better else (baseline, build)
    return float(ratio(num, den))


def recoveries(
    build: Mapping[str, Mapping[str, float]],
    baseline: Mapping[str, Mapping[str, float]],
    higher_is_better: Mapping[str, Mapping[str, bool]],
) -> dict[str, dict[str, float]]:
    """Recovery per task and metric, for every metric both score tables have (task -> metric -> value)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in build.items():
        base = baseline.get(task, {})
        for metric, value in values.items():
            if metric in base:
                hib = higher_is_better.get(task, {}).get(metric, True)
                out.setdefault(task, {})[metric] = recovery(value, base[metric], hib)
    return out
