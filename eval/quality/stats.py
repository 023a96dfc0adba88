"""Paired statistics for comparing a build with its baseline on the same documents (pure functions).

Every lm-eval metric the gate uses is a ratio of sums over documents: a mean of 0/1 or real scores
(sum of scores / number of documents) or a perplexity-type metric from per-document (log-likelihood,
length) pairs (`bits_per_byte` = -sum(ll) / sum(bytes) / ln 2). Resampling the documents with the
same indices for build and baseline (a paired bootstrap) gives a confidence interval on the
difference, on recovery and on the perplexity increase. For 0/1 outcomes the exact McNemar test on
the discordant documents is reported beside it.

A verdict is PASS when the whole interval lies on the allowed side of the threshold, FAIL when it lies
entirely beyond it, INCONCLUSIVE otherwise, with the number of documents that would likely decide it.
`Verdict` is every verdict qeval gives, this module's and the gate's (pipelines/decision/).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import numpy as np

from eval.quality import sequential


class Verdict(StrEnum):
    """What a rule, a task comparison or a whole build comes to."""

    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"  # the interval straddles the threshold: more documents would decide
    NOT_GATED = "NOT GATED"  # shown, not judged (the policy turns the rule off)
    BASELINE = "BASELINE"  # the build every other is compared with


Rule = Literal["recovery", "ppl_increase"]
_LN2 = math.log(2)
_PERPLEXITY = {"word_perplexity", "byte_perplexity", "token_perplexity", "perplexity"}


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


def doc_terms(values: Sequence[float | Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-document (numerator, denominator): a score x is (x, 1); lm-eval's [loglik, length] is itself."""
    num, den = [], []
    for v in values:
        if isinstance(v, list | tuple):
            num.append(float(v[0]))
            den.append(float(v[1]))
        else:
            num.append(float(v))
            den.append(1.0)
    return np.asarray(num), np.asarray(den)


def is_likelihood(values: Sequence[float | Sequence[float]]) -> bool:
    """True for lm-eval's [loglik, length] per-document values (perplexity-type metrics)."""
    return bool(values) and isinstance(values[0], list | tuple)


def aggregate(metric: str, num, den):
    """The metric from summed terms (works on arrays of sums, one per bootstrap replicate)."""
    ratio = num / den
    if metric == "bits_per_byte":
        return -ratio / _LN2
    if metric in _PERPLEXITY:
        return np.exp(-ratio)
    return ratio


@dataclass(frozen=True)
class Comparison:
    """One task metric of a build against the baseline, with paired intervals and a verdict."""

    metric: str
    rule: Rule
    threshold: float  # min recovery, or max perplexity increase (a fraction)
    verdict: Verdict  # PASS, FAIL or INCONCLUSIVE
    n: int
    baseline: float
    build: float
    difference: tuple[float, float, float]  # build - baseline: estimate, lower, upper
    recovery: tuple[float, float, float]  # 1.0 means as good as the baseline
    ppl_increase: tuple[float, float, float] | None  # perplexity-type metrics only
    n_to_decide: int | None  # documents at which the verdict would just be reached (samples_to_decide)
    mcnemar_p: float | None  # 0/1 outcomes only
    discordant: tuple[int, int] | None  # (baseline right only, build right only)
    method: str = "bootstrap"  # what drew the judging interval: bootstrap, or a confidence sequence (betting, mixture)
    alpha: float | None = None  # a confidence sequence's chance of a wrong PASS, this build's share of the card's
    pool: int | None = None  # the documents the task has (a sequence is tuned to it)
    resolution: float | None = None  # how far from the threshold the pool decides with 90 % power, at this spread

    @property
    def statistic(self) -> tuple[float, float, float]:
        return self.recovery if self.rule == "recovery" else self.ppl_increase  # type: ignore[return-value]


def ratio(num, den):
    """num / den where 0 / 0 is 1 (both equally bad) and x / 0 is infinite: the rule of every recovery."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = num / den
    return np.where(den == 0, np.where(num > 0, np.inf, 1.0), out)


def _replicate_sums(terms: Sequence[np.ndarray], iters: int, seed: int, chunk: int = 256) -> list[np.ndarray]:
    """Sums of each term array over `iters` resamples of the documents (the same resamples for all)."""
    n = len(terms[0])
    rng = np.random.default_rng(seed)
    out = [np.empty(iters) for _ in terms]
    for start in range(0, iters, chunk):
        k = min(chunk, iters - start)
        weights = rng.multinomial(n, np.full(n, 1.0 / n), size=k).astype(float)
        for t, acc in zip(terms, out, strict=True):
            acc[start : start + k] = weights @ t
    return out


def _interval(point: float, reps: np.ndarray, confidence: float) -> tuple[float, float, float]:
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(reps, [alpha, 1 - alpha])
    return float(point), float(lo), float(hi)


def compare(
    metric: str,
    base_values: Sequence[float | Sequence[float]],
    build_values: Sequence[float | Sequence[float]],
    *,
    higher_is_better: bool,
    rule: Rule = "recovery",
    threshold: float = 0.99,
    confidence: float = 0.95,
    iters: int = 2000,
    seed: int = 0,
    sequence: tuple[float, int, int] | None = None,
) -> Comparison:
    """Paired comparison of per-document values, in the same document order for build and baseline.

    `sequence` (alpha, documents between looks, documents in the pool): the verdict and the judging interval from
    a confidence sequence read at every look (eval/quality/sequential.py), the values in scoring order; else from the
    paired bootstrap at `confidence`, read once.

    rule "recovery": PASS when recovery >= threshold over the whole interval (recovery is
    build / baseline, or baseline / build for lower-is-better metrics).
    rule "ppl_increase": for [loglik, length] values, PASS when perplexity (exp of the mean negative
    log-likelihood per unit) rises by at most `threshold` (0.02 = 2 %) over the whole interval.
    """
    if len(base_values) != len(build_values) or not base_values:
        raise ValueError("paired samples must be non-empty and of equal length")
    likelihood = is_likelihood(base_values)
    if rule == "ppl_increase" and not likelihood:
        raise ValueError(f"metric '{metric}': a perplexity rule needs per-document log-likelihoods")
    a_num, a_den = doc_terms(base_values)
    b_num, b_den = doc_terms(build_values)
    n = len(a_num)
    sa_num, sa_den, sb_num, sb_den = _replicate_sums([a_num, a_den, b_num, b_den], iters, seed)

    def stats(an, ad, bn, bd):
        base, build = aggregate(metric, an, ad), aggregate(metric, bn, bd)
        rec = ratio(build, base) if higher_is_better else ratio(base, build)
        ppl = np.exp(-(bn / bd - an / ad)) - 1 if likelihood else None
        return base, build, rec, ppl

    base, build, rec, ppl = stats(a_num.sum(), a_den.sum(), b_num.sum(), b_den.sum())
    _, _, rec_r, ppl_r = stats(sa_num, sa_den, sb_num, sb_den)
    diff_r = aggregate(metric, sb_num, sb_den) - aggregate(metric, sa_num, sa_den)
    recovery = _interval(rec, rec_r, confidence)
    increase = _interval(ppl, ppl_r, confidence) if likelihood else None

    if rule == "recovery":
        point, lo, hi = recovery
        passed, failed = lo >= threshold, hi < threshold
    else:
        point, lo, hi = increase  # type: ignore[misc]
        passed, failed = hi <= threshold, lo > threshold
    verdict = Verdict.PASS if passed else Verdict.FAIL if failed else Verdict.INCONCLUSIVE
    extra: dict = {}
    if sequence is None:
        need = samples_to_decide(n, point, lo, hi, threshold)
    else:
        alpha, every, pool = sequence
        form, x, y, bounded = _form(metric, rule, higher_is_better, likelihood, a_num, b_num)
        side, _, (lo, hi), need = sequential.judge(
            form, x, y, a_den, threshold, point, alpha=alpha, every=every, pool=pool, bounded=bounded
        )
        verdict = Verdict.PASS if side > 0 else Verdict.FAIL if side < 0 else Verdict.INCONCLUSIVE
        if rule == "recovery":
            recovery = (point, lo, hi)
        else:
            increase = (point, lo, hi)
        d = sequential.terms(form, x, y, a_den)(threshold)
        scale = float(np.mean(y)) if form == "ratio" else float(np.mean(a_den))
        method = "betting" if bounded else "mixture"
        at = threshold if bounded else None
        extra = dict(method=method, alpha=alpha, pool=pool, resolution=_resolution(d, scale, alpha, pool, at))

    binary = not likelihood and all(v in (0.0, 1.0) for v in np.concatenate([a_num, b_num]))
    discordant = (int(np.sum((a_num == 1) & (b_num == 0))), int(np.sum((a_num == 0) & (b_num == 1))))
    return Comparison(
        metric=metric,
        rule=rule,
        threshold=threshold,
        verdict=verdict,
        n=n,
        baseline=float(base),
        build=float(build),
        difference=_interval(float(build - base), diff_r, confidence),
        recovery=recovery,
        ppl_increase=increase,
        n_to_decide=need,
        mcnemar_p=mcnemar_exact(*discordant) if binary else None,
        discordant=discordant if binary else None,
        **extra,
    )


def _form(metric: str, rule: Rule, higher: bool, likelihood: bool, a: np.ndarray, b: np.ndarray):
    """(form, x, y, bounded) of a statistic for eval/quality/sequential.py: recovery as a ratio of the better-is-larger
    sums (a perplexity's as "exp"), the perplexity rule as "increase"; scores all in [0, 1] are bounded."""
    if rule == "ppl_increase":
        return "increase", b, a, False
    if likelihood:
        if metric in _PERPLEXITY:
            return "exp", b, a, False
        return ("ratio", -a, -b, False) if metric == "bits_per_byte" or not higher else ("ratio", b, a, False)
    bounded = bool(np.all((a >= 0) & (a <= 1) & (b >= 0) & (b <= 1)))
    return ("ratio", b, a, bounded) if higher else ("ratio", a, b, bounded)


def _resolution(d: np.ndarray, scale: float, alpha: float, pool: int, betting_at: float | None) -> float | None:
    return sequential.resolution(float(d.std(ddof=1)), scale, alpha, pool, betting_at) if len(d) > 1 else None


def samples_to_decide(n: int, point: float, lower: float, upper: float, threshold: float) -> int | None:
    """Documents at which the interval would just clear the threshold, if the estimate and the per-document
    spread hold: the half-width shrinks as 1/sqrt(n). More than `n` where the interval straddles the
    threshold, at most `n` where it already clears it (how many a verdict needed). None when the estimate
    sits on the threshold, or where the estimate or its interval is not finite (a baseline that scored nothing on
    some resamples makes their recovery infinite): no number of documents can be read from it."""
    gap = abs(point - threshold)
    if gap == 0 or not all(math.isfinite(x) for x in (point, lower, upper)):
        return None
    half = (upper - lower) / 2
    need = math.ceil(n * (half / gap) ** 2)
    return max(n + 1, need) if half >= gap else max(1, need)


@dataclass(frozen=True)
class LengthBand:
    """A generative task's output length, a build against the baseline on the same documents: the ratio of
    their total generated tokens with its paired interval, held to a band around 1."""

    band: float  # the allowed relative change (0.10: at most 10 % longer or shorter)
    verdict: Verdict  # PASS: the whole interval inside the band; FAIL: wholly outside; else INCONCLUSIVE
    n: int
    baseline: float  # mean generated tokens per document
    build: float
    ratio: tuple[float, float, float]  # build / baseline: estimate, lower, upper


def length_band(
    base_lengths: Sequence[float],
    build_lengths: Sequence[float],
    *,
    band: float,
    confidence: float = 0.95,
    iters: int = 2000,
    seed: int = 0,
    sequence: tuple[float, int, int] | None = None,
) -> LengthBand:
    """Paired interval on (total build length / total baseline length), judged against [1 - band, 1 + band]:
    MLPerf's rule for its LLM benchmarks (outputs within 10 % of the reference's length), with the interval
    every other rule of the gate uses (`sequence`, as compare()'s: its confidence sequence, each edge a rule)."""
    if len(base_lengths) != len(build_lengths) or len(base_lengths) == 0:
        raise ValueError("paired lengths must be non-empty and of equal length")
    a, b = np.asarray(base_lengths, dtype=float), np.asarray(build_lengths, dtype=float)
    sa, sb = _replicate_sums([a, b], iters, seed)
    est, lo, hi = _interval(float(ratio(b.sum(), a.sum())), ratio(sb, sa), confidence)
    low, high = 1 - band, 1 + band
    verdict = (
        Verdict.PASS if low <= lo and hi <= high else Verdict.FAIL if hi < low or lo > high else Verdict.INCONCLUSIVE
    )
    if sequence is not None:  # at least 1 - band (b over a), and at most 1 + band (a over b at least its inverse)
        alpha, every, pool = sequence
        w, how = np.ones_like(a), dict(alpha=alpha, every=every, pool=pool, bounded=False)
        short, _, (lo, hi), _ = sequential.judge("ratio", b, a, w, low, est, **how)
        long, *_ = sequential.judge("ratio", a, b, w, 1 / high, 1 / est if est else 0.0, **how)
        verdict = Verdict.FAIL if -1 in (short, long) else Verdict.PASS if short == long == 1 else Verdict.INCONCLUSIVE
    return LengthBand(
        band=band, verdict=verdict, n=len(a), baseline=float(a.mean()), build=float(b.mean()), ratio=(est, lo, hi)
    )


@dataclass(frozen=True)
class Flips:
    """A multiple-choice task's answers, a build against the baseline on the same documents: how many the build
    answered otherwise, with a Wilson interval on the share. Builds flip answers at equal accuracy (a right
    answer lost here, another won there), which recovery alone cannot show: Dutta et al., "Accuracy is Not
    All You Need" (arXiv:2407.09141), count flips between right and wrong; this counts every changed answer,
    a wrong one for another wrong one too."""

    n: int
    flipped: int
    rate: tuple[float, float, float]  # flipped / n: estimate, lower, upper


def flip_rate(base_answers: Sequence[int], build_answers: Sequence[int], confidence: float = 0.95) -> Flips:
    """The share of documents whose chosen answer differs from the baseline's, with scipy's Wilson interval."""
    from scipy.stats import binomtest

    if len(base_answers) != len(build_answers) or not base_answers:
        raise ValueError("paired answers must be non-empty and of equal length")
    n = len(base_answers)
    k = sum(a != b for a, b in zip(base_answers, build_answers, strict=True))
    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return Flips(n=n, flipped=k, rate=(k / n, float(ci.low), float(ci.high)))


def percentile_interval(
    values: Sequence[float],
    q: float,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    groups: Sequence[int] | None = None,
) -> tuple[float, float, float]:
    """The q-th percentile of `values` (linear interpolation, as eval/devices/speed.py's `percentile`) with a bootstrap
    percentile interval: the values resampled with replacement `resamples` times, the percentile of each. Over
    the requests of one load level, where a p95 of 12 requests is nearly their maximum and its interval as wide
    as what separates builds; NaNs where there is no value. Where `groups` number the values by the server
    start that measured them and there is more than one, the resamples are two-stage (`two_stage`)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    if _several(groups):
        reps = np.array([np.percentile(v[i], q) for i in two_stage(groups, resamples, rng)])
    else:
        reps = np.percentile(v[rng.integers(0, v.size, size=(resamples, v.size))], q, axis=1)
    return _interval(float(np.percentile(v, q)), reps, confidence)


def _several(groups: Sequence[int] | None) -> bool:
    return groups is not None and len(set(groups)) > 1


def two_stage(groups: Sequence[int], resamples: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Index arrays of a two-stage bootstrap, one per resample: the groups (server starts) drawn with
    replacement, then each drawn group's items (its requests) with replacement; so what differs from one start
    to the next widens the interval, as the requests of one start cannot show (Davison and Hinkley, "Bootstrap
    Methods and their Application", 1997, section 3.8)."""
    g = np.asarray(groups)
    members = [np.flatnonzero(g == k) for k in np.unique(g)]
    out = []
    for _ in range(resamples):
        drawn = (members[i] for i in rng.integers(0, len(members), size=len(members)))
        out.append(np.concatenate([m[rng.integers(0, m.size, size=m.size)] for m in drawn]))
    return out


def ratio_interval(
    num: Sequence[float],
    den: Sequence[float],
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    groups: Sequence[int] | None = None,
) -> tuple[float, float, float]:
    """sum(num) / sum(den) over items resampled in pairs, with its bootstrap percentile interval: a level's
    output tokens over its requests' time (eval/load/serving.py), where the requests, not the tokens, are the
    independent draws; two-stage where `groups` number more than one server start (`two_stage`); NaNs where
    there is no item or no time."""
    n, d = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if n.size == 0 or d.sum() <= 0:
        return math.nan, math.nan, math.nan
    if _several(groups):
        picks = two_stage(groups, resamples, np.random.default_rng(seed))
        reps_n, reps_d = np.array([n[i].sum() for i in picks]), np.array([d[i].sum() for i in picks])
    else:
        reps_n, reps_d = _replicate_sums([n, d], resamples, seed)
    return _interval(float(n.sum() / d.sum()), ratio(reps_n, reps_d), confidence)


def at_most(interval: tuple[float, float, float], limit: float) -> Verdict:
    """A figure that must stay at or under `limit`, judged on its interval: PASS where the whole interval is
    within it, FAIL where the whole interval is beyond it, INCONCLUSIVE where it straddles it (or is unknown)."""
    _, lo, hi = interval
    if hi <= limit:
        return Verdict.PASS
    if lo > limit:
        return Verdict.FAIL
    return Verdict.INCONCLUSIVE
