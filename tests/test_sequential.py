"""The gate's confidence sequences (eval/quality/sequential.py) on synthetic paired documents with a known recovery,
read after every round as the gate reads them: at the threshold they pass at most alpha of the time; half a point above
it they pass at least 90 % of the time within the pool the sequence plans; a fixed-size interval read the same way
passes far more than alpha of the time at the threshold, which is why the sequence is needed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.quality import sequential

THRESHOLD, ALPHA, RUNS, EVERY = 0.99, 0.05 / 6, 2000, 100  # alpha: the card's 5 % split over ref-lm's six builds


def binary(rng, runs: int, n: int, recovery: float, right: float = 0.9, discordant: float = 0.01):
    """(build, baseline) 0/1 scores: the baseline right on `right` of documents, the two differing on `discordant`
    of them, the build's accuracy `recovery` times the baseline's."""
    lost = (discordant + right * (1 - recovery)) / 2  # right for the baseline only; discordant - lost: the build only
    u = rng.random((runs, n))
    base = (u < right).astype(float)
    build = base.copy()
    build[u < lost] = 0.0
    build[(u >= right) & (u < right + discordant - lost)] = 1.0
    return build, base


def likelihoods(rng, runs: int, n: int, recovery: float):
    """(baseline's, build's) negative log-likelihoods of chapters of varying length, the build's total `1 / recovery`
    times the baseline's, as bits per byte's recovery is."""
    length = rng.lognormal(7, 0.5, (runs, n))
    base = length * rng.normal(1.1, 0.15, (runs, n))
    return base, base / recovery + length * rng.normal(0, 0.02, (runs, n))


def shares(make, recovery: float, pool: int, bounded: bool, fixed: bool = False, seed: int = 0) -> tuple[float, float]:
    """The share of RUNS that PASS and that FAIL, each task read every EVERY documents until it is decided."""
    rng, at = np.random.default_rng(seed), sequential.looks(pool, EVERY)
    passed = failed = 0
    for _ in range(RUNS // 250):
        x, y = make(rng, 250, pool, recovery)
        d = x - THRESHOLD * y
        if fixed:  # the normal interval of a fixed number of documents, at the same alpha, read at every look
            t = np.asarray(at, dtype=float)
            mean = np.cumsum(d, -1)[:, t.astype(int) - 1] / t
            sd = np.sqrt(np.maximum(np.cumsum(d * d, -1)[:, t.astype(int) - 1] / t - mean**2, 0))
            z = 2.394  # the two-sided normal quantile at 1 - ALPHA
            up, down = (
                sequential._first(mean - z * sd / np.sqrt(t) > 0),
                sequential._first(mean + z * sd / np.sqrt(t) < 0),
            )
        else:
            up, down = sequential.first_looks(d, at, ALPHA, (-THRESHOLD, 1.0) if bounded else None, pool)
        first_up = (up >= 0) & ((down < 0) | (up <= down))
        passed += int(first_up.sum())
        failed += int(((down >= 0) & ~first_up).sum())
    return passed / RUNS, failed / RUNS


def planned_pool(make, bounded: bool) -> int:
    """The pool the sequence plans for a build half a point clear of the threshold, from one large sample's spread."""
    x, y = make(np.random.default_rng(99), 1, 200_000, THRESHOLD + 0.005)
    d = (x - THRESHOLD * y)[0]
    pool = sequential.pool_for(float(d.std()), float(y.mean()), ALPHA, 0.005, bounded)
    assert pool is not None
    return pool


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "bounded"), [(binary, True), (likelihoods, False)], ids=["0-1 scores", "log-likelihoods"]
)
def test_a_sequence_read_every_round_passes_at_the_threshold_at_most_alpha_and_decides_half_a_point_above(
    make, bounded
):
    pool = planned_pool(make, bounded)
    at_threshold, _ = shares(make, THRESHOLD, pool, bounded)
    assert at_threshold <= ALPHA, (pool, at_threshold)
    clear, wrong = shares(make, THRESHOLD + 0.005, pool, bounded, seed=1)
    assert clear >= 0.9 and wrong <= ALPHA, (pool, clear, wrong)


@pytest.mark.slow
def test_a_fixed_size_interval_read_every_round_passes_at_the_threshold_far_more_than_alpha():
    pool = 5000  # peeking inflates a fixed interval's error at any pool
    peeking, _ = shares(binary, THRESHOLD, pool, True, fixed=True)
    assert peeking > 2 * ALPHA, peeking
    valid, _ = shares(binary, THRESHOLD, pool, True)
    assert valid <= ALPHA < peeking


def test_rare_flips_do_not_pass_on_the_first_hundred_documents():
    """Two hundred documents, none flipped: no sequence can yet say a 1 % loss is ruled out, and betting does not;
    the sample-variance sequence would (every term alike), which is why scores are judged by betting."""
    d = np.full(200, 1 - THRESHOLD)
    assert sequential.decided(d, sequential.looks(200, EVERY), ALPHA, (-THRESHOLD, 1.0), 5000) == (0, 200)
    assert sequential.decided(d, sequential.looks(2000, EVERY)[:2], ALPHA, None, 5000)[0] == 1


def test_the_interval_holds_the_estimate_and_the_verdict_agrees_with_it():
    rng = np.random.default_rng(3)
    build, base = binary(rng, 1, 4000, 0.95)
    side, used, (lo, hi), need = sequential.judge(
        "ratio",
        build[0],
        base[0],
        np.ones(4000),
        THRESHOLD,
        build.sum() / base.sum(),
        alpha=ALPHA,
        every=EVERY,
        pool=4000,
        bounded=True,
    )
    assert side == -1 and used < 4000 and need == used
    assert lo < build.sum() / base.sum() < hi < THRESHOLD
    assert sequential.looks(250, 100) == [100, 200, 250] and sequential.looks(30, 100) == [30]
    assert sequential.scoring_order([3, 1, 2], 0) == sequential.scoring_order([2, 3, 1], 0)
    assert sequential.documents_to_decide(0.0, 1.0, ALPHA, 100) is None
    assert not math.isinf(sequential.resolution(1.0, 1.0, ALPHA, 100) or math.inf)


def test_a_build_that_scores_as_its_baseline_passes_no_sooner_than_the_betting_floor():
    """A 0/1 task 39 % right at threshold 0.96: betting passes a build identical to its baseline about where
    `betting_floor` says (the wealth's growth is capped by the stake), and a resolution read at a pool shorter
    than that floor is no finer than the gap such a build has (1 - 0.96)."""
    m, mu, alpha = 0.96, 0.394, ALPHA
    floor = sequential.betting_floor((1 - m) * mu, -m, 1.0, alpha)
    y = (np.random.default_rng(3).random((100, 2500)) < mu).astype(float)
    wealth = sequential.bet_log_wealth((1 - m) * y, -m)
    passed = (wealth >= math.log(1 / alpha)).argmax(-1) + 1
    assert (wealth >= math.log(1 / alpha)).any(-1).all()
    assert 0.85 * floor <= np.median(passed) <= 1.2 * floor
    assert sequential.resolution(0.01, mu, alpha, floor // 2, betting_at=m) > 1 - m
