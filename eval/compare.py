"""Comparisons of a build with its baseline: pure functions on numbers, unit-tested by hand."""

from __future__ import annotations

import math
from collections.abc import Mapping


def recovery(build: float, baseline: float, higher_is_better: bool) -> float:
    """build / baseline, or baseline / build for lower-is-better metrics: 1.0 always means "as good"."""
    num, den = (build, baseline) if higher_is_better else (baseline, build)
    if den == 0:
        return math.inf if num > 0 else 1.0
    return num / den


def recoveries(
    build: Mapping[str, Mapping[str, object]],
    baseline: Mapping[str, Mapping[str, object]],
    higher_is_better: Mapping[str, Mapping[str, bool]],
) -> dict[str, dict[str, float]]:
    """Recovery per task and metric for every numeric metric both results share (stderrs excluded).

    Inputs are lm-eval `results` sections keyed `metric,filter`; the output is keyed by task, then by
    `metric,filter` as well, so that tracking names them the same way as the scores themselves.
    """
    out: dict[str, dict[str, float]] = {}
    for task, values in build.items():
        base = baseline.get(task, {})
        for key, value in values.items():
            metric = key.split(",", 1)[0]
            if "," not in key or metric.endswith("_stderr") or key not in base:
                continue
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (value, base[key])):
                continue
            hib = higher_is_better.get(task, {}).get(metric, True)
            out.setdefault(task, {})[key] = recovery(float(value), float(base[key]), hib)
    return out
