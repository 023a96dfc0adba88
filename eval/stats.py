"""Paired statistics for comparing a build with its baseline on the same documents (pure functions).

The gate compares per-document outcomes of build and baseline: exact McNemar for 0/1 outcomes, a
paired bootstrap for any per-document score (log-likelihoods, accuracies), giving a confidence
interval on the difference. A verdict is PASS when the whole interval lies within the allowed loss,
FAIL when it lies entirely beyond it, INCONCLUSIVE otherwise, with the sample size that would decide.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist, fmean, stdev


def mcnemar_exact(base_only: int, build_only: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs.

    `base_only`: documents the baseline got right and the build wrong; `build_only`: the reverse.
    """
    n = base_only + build_only
    if n == 0:
        return 1.0
    k = min(base_only, build_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap_ci(
    base: Sequence[float], build: Sequence[float], confidence: float = 0.95, iters: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean difference build - base, lower, upper) with a percentile bootstrap over documents."""
    if len(base) != len(build) or not base:
        raise ValueError("paired samples must be non-empty and of equal length")
    diffs = [b - a for a, b in zip(base, build, strict=True)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(fmean(rng.choices(diffs, k=n)) for _ in range(iters))
    alpha = (1 - confidence) / 2
    lo = means[max(0, math.floor(alpha * iters))]
    hi = means[min(iters - 1, math.ceil((1 - alpha) * iters) - 1)]
    return fmean(diffs), lo, hi


@dataclass(frozen=True)
class Verdict:
    verdict: str  # PASS, FAIL or INCONCLUSIVE
    difference: float
    lower: float
    upper: float
    n: int
    n_to_decide: int | None  # documents that would likely decide an INCONCLUSIVE case


def decide(
    base: Sequence[float],
    build: Sequence[float],
    allowed_loss: float,
    higher_is_better: bool = True,
    confidence: float = 0.95,
    seed: int = 0,
) -> Verdict:
    """Verdict on a build's per-document scores against the baseline's, allowing `allowed_loss`.

    The loss is measured in the metric's own units on the mean (for recovery r on a baseline mean m,
    allowed_loss = (1 - r) * m). For lower-is-better metrics the signs are flipped.
    """
    sign = 1.0 if higher_is_better else -1.0
    mean, lo, hi = paired_bootstrap_ci([sign * x for x in base], [sign * x for x in build], confidence, seed=seed)
    n = len(base)
    if lo >= -allowed_loss:
        return Verdict("PASS", mean, lo, hi, n, None)
    if hi < -allowed_loss:
        return Verdict("FAIL", mean, lo, hi, n, None)
    return Verdict("INCONCLUSIVE", mean, lo, hi, n, samples_to_decide(base, build, allowed_loss, sign, confidence))


def samples_to_decide(
    base: Sequence[float], build: Sequence[float], allowed_loss: float, sign: float, confidence: float
) -> int | None:
    """Documents needed for the interval's half-width to shrink to the gap between the mean and the
    threshold, if the observed mean and spread hold (normal approximation)."""
    diffs = [sign * (b - a) for a, b in zip(base, build, strict=True)]
    if len(diffs) < 2:
        return None
    gap = abs(fmean(diffs) + allowed_loss)
    spread = stdev(diffs)
    if gap == 0 or spread == 0:
        return None
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    return math.ceil((z * spread / gap) ** 2)
