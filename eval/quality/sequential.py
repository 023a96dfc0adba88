"""Anytime-valid paired verdicts: confidence sequences that hold at every look, so that a verdict read after any
round of documents, or at the first that decides, means what it says.

An interval drawn for a fixed number of documents is valid once; read after every round until it clears, its
chance of a wrong PASS grows with the looks (tests/test_sequential.py measures it). A confidence sequence holds
at all of them at once. Every rule of the gate is the sign of a mean of per-document terms: recovery is at least
m exactly when the documents' mean of `x - m*y` is at least 0 (x the build's score, y the baseline's; for a
perplexity-type metric x the baseline's negative log-likelihood, y the build's), and likewise the perplexity
increase, the gain over a control and the output-length band (eval/quality/stats.py, `terms`). So one test of
"mean >= 0" against "mean < 0" judges each, and inverting it over m gives the interval shown.

Two sequences, by what the terms are:
- scores in [0, 1] per document (accuracy, exact match, chrF): testing by betting (Waudby-Smith and Ramdas,
  "Estimating means of bounded random variables by betting", JRSS-B 2023). A wealth bets each document's term
  with a stake set from the documents before it; by Ville's inequality its chance of ever reaching 1/alpha while
  the mean is on the other side is at most alpha. It holds at any number of documents, rare discordant pairs
  included (where an interval from the sample variance is far too narrow on the first hundred documents);
- anything unbounded (log-likelihoods, gains over a control, token counts): the asymptotic confidence sequence of
  Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas ("Time-uniform central limit theory and asymptotic confidence
  sequences", Annals of Statistics 2024): Robbins' normal-mixture boundary with the sample's standard deviation,
  its mixing width tuned to the task's pool (Howard, Ramdas, McAuliffe and Sekhon, "Time-uniform, nonparametric,
  nonasymptotic confidence sequences", Annals of Statistics 2021, eq. 3.12).
Verdicts are read at the looks only: the ends of the scoring rounds, the first at least FIRST_LOOK documents.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import numpy as np

CAP = 0.75
"""The largest stake, as a share of what a term at its bound could take: below 1 so that one document can never
lose the whole wealth (the hedged capital process of Waudby-Smith and Ramdas uses 1/2 to 3/4)."""
FIRST_LOOK = 50
"""Documents before the first look: the asymptotic sequence's standard deviation needs some to mean anything."""
POWER_Z = 1.2815515655446004
"""The standard normal's 90th percentile: the power at which a pool's resolution is stated."""


def looks(n: int, every: int) -> list[int]:
    """The document counts a verdict is read at: every `every` documents from FIRST_LOOK on, and `n`."""
    first = max(FIRST_LOOK, every)
    return sorted({*range(first, n, every), n}) if n >= 1 else []


def bet_log_wealth(d: np.ndarray, lower: float) -> np.ndarray:
    """The log wealth after each document of a bettor against "mean of d <= 0", for terms at least `lower` (< 0),
    along the last axis (several runs at once where d has more). The stake on a document is
    the Kelly fraction from the documents before it (aGRAPA: mean / (variance + mean^2)), a prior of one term at
    0 with a variance of a quarter, held to [0, CAP / -lower] so that the wealth stays positive."""
    n = d.shape[-1]
    zero = np.zeros((*d.shape[:-1], 1))
    before = np.arange(1, n + 1)  # documents seen before each, plus the prior's one
    mean = np.concatenate([zero, np.cumsum(d, -1)[..., :-1]], -1) / before
    second = (np.concatenate([zero, np.cumsum(d * d, -1)[..., :-1]], -1) + 0.25) / before
    var = np.maximum(second - mean * mean, 1e-12)
    stake = np.clip(mean / (var + mean * mean), 0.0, CAP / -lower)  # a term at the upper end only adds
    return np.cumsum(np.log1p(stake * d), -1)


def mixture_radius(t, sd, alpha: float, pool: int):
    """Half-width of the two-sided asymptotic confidence sequence for a mean after t terms with standard deviation
    sd: sd * sqrt(2 (t r^2 + 1) / (t^2 r^2) * log(sqrt(t r^2 + 1) / alpha)), with r^2 set so that the boundary is
    tightest at t = pool."""
    la = -2 * math.log(alpha)
    r2 = (la + math.log(la + 1)) / max(pool, 1)
    t = np.asarray(t, dtype=float)
    return sd * np.sqrt(2 * (t * r2 + 1) / (t * t * r2) * np.log(np.sqrt(t * r2 + 1) / alpha))


def first_looks(
    d: np.ndarray, at: list[int], alpha: float, bounds: tuple[float, float] | None, pool: int
) -> tuple[np.ndarray, np.ndarray]:
    """For terms d (documents along the last axis, in scoring order) read at the document counts `at`: the index
    into `at` of the first look where "mean >= 0" is established (PASS), and the first where "mean < 0" is
    (FAIL); -1 where none. `bounds`: the terms' range, for the betting test; None: the asymptotic sequence."""
    idx = np.asarray(at) - 1
    if bounds is not None:
        lo, hi = bounds
        level = math.log(1 / alpha)
        up = bet_log_wealth(d, lo)[..., idx] >= level
        down = bet_log_wealth(-d, -hi)[..., idx] >= level
    else:
        t = np.asarray(at, dtype=float)
        s1, s2 = np.cumsum(d, -1)[..., idx], np.cumsum(d * d, -1)[..., idx]
        mean = s1 / t
        sd = np.sqrt(np.maximum(s2 / t - mean * mean, 0) * t / np.maximum(t - 1, 1))
        r = mixture_radius(t, sd, alpha, pool)
        up, down = mean - r > 0, mean + r < 0  # a spread of 0 (every term alike) decides at the first look
    return _first(up), _first(down)


def _first(hit: np.ndarray) -> np.ndarray:
    return np.where(hit.any(-1), hit.argmax(-1), -1)


def decided(
    d: np.ndarray, at: list[int], alpha: float, bounds: tuple[float, float] | None, pool: int
) -> tuple[int, int]:
    """One task's terms: (1, documents) where "mean >= 0" was established first, (-1, documents) where "mean < 0"
    was, (0, documents scored) where neither has been."""
    if not at:
        return 0, 0
    up, down = (int(v) for v in first_looks(d, at, alpha, bounds, pool))
    if up >= 0 and (down < 0 or up <= down):
        return 1, at[up]
    if down >= 0:
        return -1, at[down]
    return 0, at[-1]


def invert(
    terms: Callable[[float], np.ndarray],
    estimate: float,
    at: list[int],
    alpha: float,
    bounds: Callable[[float], tuple[float, float] | None],
    pool: int,
    increasing: bool,
) -> tuple[float, float]:
    """The confidence sequence's interval on a statistic, at the last look: every threshold m neither test
    excludes, where `terms(m)`'s mean is >= 0 exactly when the statistic is on the passing side of m (`increasing`:
    the statistic at least m, as recovery; else at most m, as a perplexity increase). Found by bisection from the
    estimate outward (the tests are monotone in m but for the stakes' adaptivity)."""

    def side(m: float) -> int:
        return decided(terms(m), at, alpha, bounds(m), pool)[0]

    span = max(abs(estimate), 1.0)
    below, above = estimate - 4 * span, estimate + 4 * span
    passing_edge = _edge(side, estimate, below if increasing else above, 1)
    failing_edge = _edge(side, estimate, above if increasing else below, -1)
    return (passing_edge, failing_edge) if increasing else (failing_edge, passing_edge)


def _edge(side: Callable[[float], int], inside: float, outside: float, verdict: int) -> float:
    """Where `side` turns to `verdict` between `inside` (where it is not) and `outside`; +-inf where even
    `outside` is not."""
    if side(outside) != verdict:
        return -math.inf if outside < inside else math.inf
    for _ in range(40):
        mid = (inside + outside) / 2
        if side(mid) == verdict:
            outside = mid
        else:
            inside = mid
    return outside


def documents_to_decide(mean: float, sd: float, alpha: float, pool: int) -> int | None:
    """About how many documents the sequence would need to decide terms of this mean and standard deviation
    (the normal-mixture boundary's, for either sequence): the fewest t whose radius is below |mean|; None where
    the mean is 0 or the figures are not finite."""
    if mean == 0 or not (math.isfinite(mean) and math.isfinite(sd)):
        return None
    if sd == 0:
        return FIRST_LOOK
    t = FIRST_LOOK
    while mixture_radius(t, sd, alpha, pool) >= abs(mean):
        t = math.ceil(t * 1.05)
        if t > 10**9:
            return None
    return t


def resolution(sd: float, scale: float, alpha: float, pool: int, betting_at: float | None = None) -> float | None:
    """How far from its threshold a statistic must lie for a task of `pool` documents to decide it with 90 %
    power, at terms' standard deviation `sd` (from the baseline and the documents scored): the boundary's radius
    at the pool plus the power's margin, in the statistic's units (`scale`: how much the terms' mean moves per
    unit of the statistic, the baseline's mean score for recovery). `betting_at`: scores in [0, 1] judged by
    betting at this recovery threshold, which no spread lets decide sooner than `betting_floor`. None where it
    cannot be read."""
    if pool < 1 or scale <= 0 or not math.isfinite(sd):
        return None
    normal = float((mixture_radius(pool, sd, alpha, pool) + POWER_Z * sd / math.sqrt(pool)) / scale)
    if betting_at is None:
        return normal
    return max(normal, math.log(1 / alpha) * betting_at / (CAP * scale * pool))


def betting_floor(mean: float, lower: float, upper: float, alpha: float) -> int | None:
    """The fewest documents in which betting can decide terms of this mean within [lower, upper] at all, however
    alike they are: a document adds at most stake * term to the log wealth, the stake at most CAP over the bound
    on the other side (`lower` to establish a mean >= 0, `upper` a mean < 0), and the wealth must reach 1/alpha.
    For a build that scores every document as its baseline does at recovery threshold m the mean is (1 - m) times
    the baseline's mean score: no valid test can tell it sooner from one that loses that share of its documents
    outright (docs/gate.md). None for a mean of 0."""
    if mean == 0 or not math.isfinite(mean):
        return None
    bound = -lower if mean > 0 else upper
    return math.ceil(math.log(1 / alpha) * bound / (CAP * abs(mean)))


Form = str
"""How a statistic's threshold m becomes per-document terms whose mean is >= 0 exactly on its passing side, for
paired per-document (numerator, denominator) terms a (baseline) and b (build), the denominators shared:
"ratio" sum(x) / sum(y) >= m, x and y the better-is-larger sides (`terms`); "exp" exp((sum(b) - sum(a)) / sum(w))
>= m, a perplexity's recovery; "increase" exp(-(sum(b) - sum(a)) / sum(w)) - 1 <= m, a perplexity's increase."""


def terms(form: Form, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> Callable[[float], np.ndarray]:
    """The terms at threshold m of a statistic of `form` (see Form): for "ratio", x - m y; for "exp", with x and y
    the build's and the baseline's log-likelihoods and w their shared lengths, x - y - w log m; for "increase",
    x - y + w log(1 + m)."""
    if form == "ratio":
        return lambda m: x - m * y
    if form == "exp":
        return lambda m: x - y - w * math.log(max(m, 1e-300))
    return lambda m: x - y + w * math.log1p(max(m, -1 + 1e-300))


def judge(
    form: Form,
    x: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    threshold: float,
    estimate: float,
    *,
    alpha: float,
    every: int,
    pool: int,
    bounded: bool,
) -> tuple[int, int, tuple[float, float], int | None]:
    """One paired statistic judged by its confidence sequence: (1 on its passing side, -1 its failing side, 0
    undecided; the documents that decided it, or those scored; the interval at the last look; about how many
    documents would decide it). `bounded`: x and y are scores in [0, 1] ("ratio" only), judged by betting; else
    the asymptotic sequence. Documents in x, y and w are in scoring order."""
    at = looks(len(x), every)
    of = terms(form, x, y, w)
    bounds = (lambda m: (-max(m, 1e-9), 1.0)) if bounded else (lambda m: None)  # m <= 0: every term is >= 0
    increasing = form != "increase"
    side, used = decided(of(threshold), at, alpha, bounds(threshold), pool)
    interval = invert(of, estimate, at, alpha, bounds, pool, increasing)
    if bounded:  # scores in [0, 1]: a ratio of their sums is never below 0
        interval = (max(interval[0], 0.0), max(interval[1], 0.0))
    d = of(threshold)
    sd = float(d.std(ddof=1)) if len(d) > 1 else 0.0
    need = used if side else documents_to_decide(float(d.mean()), sd, alpha, pool)
    if bounded and not side and need is not None:
        need = max(need, betting_floor(float(d.mean()), *bounds(threshold), alpha) or 0)  # type: ignore[misc]
    return side, used, interval, need


def scoring_order(keys: list, seed: int) -> list:
    """Documents in the order they are scored and judged in: a seeded shuffle, the same for the baseline and every
    build. Each document's place is from a hash of the seed and its index alone (the last part of a (task, index)
    key), so that it keeps it whatever others a pool holds, and a task and its control, the same items, share one
    order; a group's subtasks' documents of one index follow by name."""

    def place(key) -> tuple[bytes, str]:
        index = key[-1] if isinstance(key, tuple) else key
        return hashlib.sha256(f"{seed}\0{index}".encode()).digest(), str(key)

    return sorted(keys, key=place)


BETTING_COST = 2.0
"""How many times the documents of the normal-mixture estimate the betting test needs for the same power: its
stakes are learnt from the documents as they come (tests/test_sequential.py measures 90 % power with it)."""


def pool_for(sd: float, scale: float, alpha: float, gap: float, bounded: bool) -> int | None:
    """The fewest documents in which a statistic `gap` clear of its threshold is decided with 90 % power, at terms'
    standard deviation `sd` (`resolution`'s units); None where it cannot be read."""
    if not (sd > 0 and scale > 0 and gap > 0):
        return None
    lo, hi = FIRST_LOOK, FIRST_LOOK
    while (r := resolution(sd, scale, alpha, hi)) is None or r > gap:
        lo, hi = hi, hi * 2
        if hi > 10**9:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if (resolution(sd, scale, alpha, mid) or math.inf) <= gap else (mid, hi)
    return math.ceil(hi * (BETTING_COST if bounded else 1))
