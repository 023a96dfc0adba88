"""Speed-ups of a build's sweep over the baseline's, level by level, with their intervals, and where they cross 1
(pure functions on eval/load/serving.py's LevelMetrics). A speed-up is output tokens/s over the baseline's at the same
users; its interval comes from both levels' throughput intervals over their requests; a crossing whose speed-up
cannot be told from 1 is within the noise."""

from __future__ import annotations

import itertools
import math

from eval.load.serving import LevelMetrics


def speedups(base: dict[int, LevelMetrics], build: dict[int, LevelMetrics]) -> dict[int, float]:
    """Output tokens/s of a build over the baseline's at each number of users both were swept at."""
    return {
        c: build[c].output_tps / base[c].output_tps
        for c in sorted(set(base) & set(build))
        if build[c].output_tps and base[c].output_tps
    }


def speedup_intervals(base: dict[int, LevelMetrics], build: dict[int, LevelMetrics]) -> dict[int, tuple[float, float]]:
    """Each speed-up's interval, where both levels' throughputs have one: the two sweeps are independent, so
    the log-ratio's half-widths add in quadrature (each side from the two ends that push it that way)."""
    out = {}
    for c, up in speedups(base, build).items():
        a, b = base[c], build[c]
        if a.output_tps_interval is None or b.output_tps_interval is None:
            continue
        if not min(*a.output_tps_interval, *b.output_tps_interval):  # a zero end has no log
            continue
        (a_lo, a_hi), (b_lo, b_hi) = a.output_tps_interval, b.output_tps_interval
        down = math.hypot(math.log(b.output_tps / b_lo), math.log(a_hi / a.output_tps))
        up_w = math.hypot(math.log(b_hi / b.output_tps), math.log(a.output_tps / a_lo))
        out[c] = (up * math.exp(-down), up * math.exp(up_w))
    return out


def within_noise(span: tuple[float, float] | None) -> bool:
    """A speed-up whose interval holds 1: faster or slower than the baseline cannot be told apart there."""
    return span is not None and span[0] <= 1 <= span[1]


def crossovers(
    ups: dict[int, float], spans: dict[int, tuple[float, float]] | None = None
) -> list[tuple[int, str, bool]]:
    """Where a speed-up crosses 1 between two swept levels: (the first level on the new side, "stops paying
    off" or "starts paying off", whether it is within the noise), in increasing users. A crossing is within the
    noise where either level's speed-up interval (`spans`, speedup_intervals) holds 1; without both intervals
    it is taken as measured."""
    spans = spans or {}
    out = []
    levels = sorted(ups)
    for a, b in itertools.pairwise(levels):
        noise = within_noise(spans.get(a)) or within_noise(spans.get(b))
        if ups[a] > 1 >= ups[b]:
            out.append((b, "stops paying off", noise))
        elif ups[a] <= 1 < ups[b]:
            out.append((b, "starts paying off", noise))
    return out
