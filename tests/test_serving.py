"""Server-benchmark metrics on hand-made timestamp traces with known answers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from eval.load.serving import (
    LevelMetrics,
    RequestRecord,
    Slo,
    level_metrics,
    max_users_at_slo,
    read_csv,
    sweep_metrics,
    write_csv,
)


def _request(c: int, i: int, start: float, ttft: float, gap: float, tokens: int) -> RequestRecord:
    """A request whose first token comes `ttft` s after `start`, then one token every `gap` s."""
    times = tuple(start + ttft + k * gap for k in range(tokens))
    return RequestRecord(c, i, start, times[-1], True, times[0], tokens, 8, times)


def test_one_request_by_hand():
    r = _request(1, 0, start=10.0, ttft=0.2, gap=0.05, tokens=5)  # tokens at 10.2, .25, .30, .35, .40
    assert r.ttft == pytest.approx(0.2) and r.e2e == pytest.approx(0.4)
    assert r.tpot == pytest.approx(0.05) and r.itls == pytest.approx([0.05] * 4)


def test_level_metrics_throughput_goodput_and_percentiles():
    slo = Slo(ttft_ms=300, tpot_ms=60)
    reqs = [
        _request(2, 0, 0.0, 0.1, 0.05, 11),  # ends at 0.6; meets both objectives
        _request(2, 1, 0.0, 0.4, 0.05, 11),  # TTFT 400 ms: misses
        _request(2, 2, 0.6, 0.1, 0.10, 11),  # TPOT 100 ms: misses; ends at 1.7
        _request(2, 3, 0.9, 0.1, 0.05, 11),  # ends at 1.5; meets
    ]
    m = level_metrics(reqs, slo)
    assert m.requests == 4 and m.failed == 0
    assert m.duration_s == pytest.approx(1.7)
    assert m.request_tps == pytest.approx(4 / 1.7) and m.output_tps == pytest.approx(44 / 1.7)
    assert m.goodput_rps == pytest.approx(2 / 1.7) and m.slo_attainment == 0.5
    assert m.ttft_ms_p50 == pytest.approx(100) and m.ttft_ms_p99 == pytest.approx(400 - 0.03 * 300)
    assert m.ttft_ms_p90 == pytest.approx(400 - 0.3 * 300)
    assert m.tpot_ms_p50 == pytest.approx(50) and m.itl_ms_p50 == pytest.approx(50)
    assert m.output_tps_per_user == pytest.approx(20)
    assert not m.meets_slo  # p95 TTFT 391 ms > 300 ms


def test_a_failed_request_is_counted_and_fails_the_level():
    slo = Slo(ttft_ms=1000, tpot_ms=1000)
    ok = [_request(1, i, i * 1.0, 0.1, 0.01, 4) for i in range(3)]
    assert level_metrics(ok, slo).meets_slo
    failed = RequestRecord(1, 3, 3.0, 3.5, False, error="timeout")
    m = level_metrics([*ok, failed], slo)
    assert m.failed == 1 and m.requests == 4 and not m.meets_slo
    assert m.slo_attainment == 0.75
    alone = level_metrics([failed], slo)
    assert (alone.requests, alone.failed, alone.meets_slo, alone.goodput_rps) == (1, 1, False, 0.0)
    assert alone.ttft_ms_p50 is None and alone.output_tps is None


def test_tokens_that_arrive_in_one_burst_were_not_streamed_and_the_level_is_not_counted():
    slo = Slo(ttft_ms=1000, tpot_ms=1000)
    streamed = [_request(1, i, i * 1.0, 0.02, 0.004, 32) for i in range(2)]  # 4 ms per token
    assert not any(r.burst for r in streamed) and level_metrics(streamed, slo).meets_slo
    # as recorded once from vLLM on 2 cores: 32 tokens within half a millisecond, 145 ms after the start
    burst = _request(1, 2, 2.0, 0.145, 0.000015, 32)
    m = level_metrics([*streamed, burst], slo)
    assert burst.burst and m.bursts == 1 and not m.meets_slo and m.failed == 0
    assert not _request(1, 3, 3.0, 0.1, 0.0, 2).burst  # two tokens may well come in one chunk


def _level(meets: bool) -> LevelMetrics:
    return LevelMetrics(requests=1, failed=0, meets_slo=meets)


def test_max_users_is_the_largest_level_with_every_lower_level_meeting_the_slo():
    assert max_users_at_slo({1: _level(True), 2: _level(True), 4: _level(False)}) == 2
    assert max_users_at_slo({1: _level(False), 2: _level(True)}) == 0
    slo = Slo(ttft_ms=150, tpot_ms=60)
    sweep = [_request(1, 0, 0, 0.1, 0.05, 4), _request(2, 0, 5, 0.1, 0.05, 4), _request(2, 1, 5, 0.2, 0.05, 4)]
    per_level = sweep_metrics(sweep, slo)
    assert list(per_level) == [1, 2] and max_users_at_slo(per_level) == 1


def test_records_survive_the_csv(tmp_path):
    reqs = [_request(2, 0, 0.0, 0.1, 0.05, 3), RequestRecord(2, 1, 0.0, 1.0, False, error="HTTP 500: boom")]
    write_csv(reqs, tmp_path / "r.csv")
    back = read_csv(tmp_path / "r.csv")
    assert back[1] == reqs[1]
    stalled = RequestRecord(2, 2, 0.0, 1.0, True, client_stall_ms=250.0)
    write_csv([stalled], tmp_path / "s.csv")
    assert read_csv(tmp_path / "s.csv") == [stalled]
    assert back[0].token_times == pytest.approx(reqs[0].token_times) and back[0].output_tokens == 3


def test_a_percentiles_bootstrap_interval_by_hand():
    from eval.quality.stats import percentile_interval

    assert percentile_interval([7.0] * 12, 95) == (7.0, 7.0, 7.0)  # no spread, no interval
    assert all(math.isnan(x) for x in percentile_interval([], 95))
    values = [float(v) for v in range(1, 101)]
    point, lo, hi = percentile_interval(values, 50)
    assert point == 50.5 and 40 < lo < point < hi < 61  # the median of 100 values: about +-1 standard error x 2
    assert percentile_interval(values, 50) == (point, lo, hi)  # seeded: the same interval every time
    # a p95 of 12 requests is nearly their largest: its interval reaches down among the ordinary ones
    twelve = [100.0] * 10 + [150.0, 400.0]
    p95, low, high = percentile_interval(twelve, 95)
    assert p95 == pytest.approx(150 + 0.45 * 250) and low == 100.0 and high == 400.0


def test_a_levels_throughput_interval_by_hand():
    # one user, request after request: 9 tokens in each, half of them taking 1 s and half 3 s
    reqs, t = [], 0.0
    for i in range(40):
        gap = (1.0 if i % 2 else 3.0) / 9
        reqs.append(_request(1, i, t, ttft=gap, gap=gap, tokens=9))
        t = reqs[-1].end
    m = level_metrics(reqs, Slo(10_000, 10_000))
    assert m.output_tps == pytest.approx(360 / 80)  # tokens over the level's wall time
    lo, hi = m.output_tps_interval
    # the mean time of 40 requests: 2 s with a standard error of 1 / sqrt(40), so about 4.5 x 2 / (2 -+ 0.31)
    assert lo == pytest.approx(4.5 * 2 / 2.31, rel=0.03) and hi == pytest.approx(4.5 * 2 / 1.69, rel=0.03)
    same = [_request(1, i, 2.25 * i, ttft=0.25, gap=0.25, tokens=9) for i in range(12)]  # 9 tokens in 2.25 s
    assert level_metrics(same, Slo(10_000, 10_000)).output_tps_interval == pytest.approx((4.0, 4.0))  # no spread


def test_intervals_over_several_server_starts_by_hand():
    from eval.quality.stats import percentile_interval, ratio_interval

    # two starts, each steady within itself: 100 ms in the first, 300 ms in the second
    values, starts = [100.0] * 10 + [300.0] * 10, [0] * 10 + [1] * 10
    assert percentile_interval(values, 95) == (300.0, 300.0, 300.0)  # the requests alone: no doubt at all
    # the starts drawn first: a quarter of the resamples are the first start twice over
    assert percentile_interval(values, 95, groups=starts) == (300.0, 100.0, 300.0)
    assert percentile_interval(values, 95, groups=[0] * 20) == percentile_interval(values, 95)  # one start: as before
    tokens, seconds = [10.0] * 20, [1.0] * 10 + [3.0] * 10
    assert ratio_interval(tokens, seconds, groups=starts) == pytest.approx((5.0, 10 / 3, 10.0))
    # a level's wall time is summed over its starts, not taken across the pause between them
    first = [_request(1, i, 2.0 * i, ttft=2 / 9, gap=2 / 9, tokens=9) for i in range(5)]  # 10 s
    later = [replace(_request(1, i, 500 + 2.0 * i, ttft=2 / 9, gap=2 / 9, tokens=9), run=1) for i in range(5)]
    m = level_metrics(first + later, Slo(10_000, 10_000))
    assert m.duration_s == pytest.approx(20.0) and m.output_tps == pytest.approx(90 / 20)


def test_a_speedups_interval_and_a_crossing_within_the_noise_by_hand():
    from eval.load.speedup import crossovers, speedup_intervals
    from pipelines.core.store.formats import crossing

    def level(tps: float, lo: float, hi: float) -> LevelMetrics:
        return LevelMetrics(requests=8, failed=0, meets_slo=True, output_tps=tps, output_tps_interval=(lo, hi))

    base = {1: level(100, 90, 110), 4: level(200, 190, 210), 16: level(300, 290, 310)}
    build = {1: level(120, 108, 132), 4: level(196, 186, 206), 16: level(240, 230, 250)}
    spans = speedup_intervals(base, build)
    # 1.2 x exp(-+ sqrt(log(120/108)^2 + log(110/100)^2)): the two sweeps' widths added in quadrature
    assert spans[1] == pytest.approx((1.2 * math.exp(-0.14208), 1.2 * math.exp(0.14208)), rel=1e-4)
    assert spans[1][0] > 1 and spans[4][0] < 1 < spans[4][1] and spans[16][1] < 1
    ups = {1: 1.2, 4: 0.98, 16: 0.8}
    assert crossovers(ups, spans) == [(4, "stops paying off", True)]  # 0.98 cannot be told from 1
    assert crossovers(ups, {1: spans[1], 16: spans[16]}) == [(4, "stops paying off", False)]  # 4: no interval
    assert crossovers({1: 1.2, 16: 0.8}, spans) == [(16, "stops paying off", False)]  # both ends clear
    assert crossing(ups, "bf16", spans) == "stops paying off at 4 users (within the noise)"
    assert crossing({1: 1.2, 16: 1.1}, "bf16") == "faster than bf16 at every level swept"
    assert (
        crossing({1: 1.2, 4: 1.1}, "bf16", spans)
        == "faster than bf16 at every level swept (within the noise at 4 users)"
    )
    assert (
        crossing({1: 0.98, 4: 0.8}, "bf16", {1: (0.9, 1.05), 4: (0.7, 0.9)})
        == "slower than bf16 at every level swept (within the noise at 1 user)"
    )
    assert speedup_intervals(base, {1: LevelMetrics(requests=1, failed=0, meets_slo=True, output_tps=120)}) == {}


def test_a_level_meets_misses_or_is_too_close_to_call_on_its_intervals():
    from eval.load.serving import level_verdict
    from eval.quality.stats import Verdict, at_most

    slo = Slo(ttft_ms=200, tpot_ms=25)
    assert at_most((1.5, 1.0, 2.0), 2.0) == Verdict.PASS and at_most((1.5, 1.0, 2.0), 0.5) == Verdict.FAIL
    assert at_most((1.5, 1.0, 2.0), 1.5) == Verdict.INCONCLUSIVE
    assert at_most((math.nan,) * 3, 1.0) == Verdict.INCONCLUSIVE  # unknown: not met
    good_tpot = (10.0, 9.0, 11.0)
    assert level_verdict(0, (150.0, 120.0, 190.0), good_tpot, slo) == Verdict.PASS
    assert level_verdict(0, (190.0, 150.0, 260.0), good_tpot, slo) == Verdict.INCONCLUSIVE  # 203 vs 200 ms
    assert level_verdict(0, (250.0, 210.0, 300.0), good_tpot, slo) == Verdict.FAIL
    assert level_verdict(0, (150.0, 120.0, 190.0), (30.0, 26.0, 40.0), slo) == Verdict.FAIL
    assert level_verdict(1, (150.0, 120.0, 190.0), good_tpot, slo) == Verdict.FAIL  # a failed request
    # a request not streamed: met no longer, missed only where its TTFT (its whole decode) says so
    assert level_verdict(0, (150.0, 120.0, 190.0), good_tpot, slo, bursts=1) == Verdict.INCONCLUSIVE
    assert level_verdict(0, (250.0, 210.0, 300.0), good_tpot, slo, bursts=1) == Verdict.FAIL


def test_users_within_the_objective_are_a_range_over_the_judged_levels():
    from eval.load.serving import users_interval
    from eval.quality.stats import Verdict

    def levels(*verdicts):
        return {
            c: LevelMetrics(requests=3, failed=0, meets_slo=v == Verdict.PASS, slo_verdict=v)
            for c, v in zip((1, 4, 16), verdicts, strict=False)
        }

    P, U, F = Verdict.PASS, Verdict.INCONCLUSIVE, Verdict.FAIL  # met, too close to call, missed
    assert users_interval(levels(P, U, F)) == (1, 15)  # 5 to 15 untested: unknown
    assert users_interval(levels(P, P, F)) == (4, 15)
    assert users_interval(levels(P, P, U)) == (4, 16)
    assert users_interval(levels(P, P, P)) == (16, 16)  # the edge beyond the grid: 16 is what was judged
    assert users_interval(levels(U, P, F)) == (0, 15)  # the first level too close to call: none for certain
    assert users_interval(levels(F, P, P)) == (0, 0)
    assert users_interval({1: LevelMetrics(requests=1, failed=0, meets_slo=True)}) is None  # not judged so


def test_each_level_is_judged_on_its_requests_intervals():
    quick = [_request(1, i, float(i), 0.05 + 0.001 * i, 0.01, 8) for i in range(12)]
    m = level_metrics(quick, Slo(ttft_ms=200, tpot_ms=25))
    lo, hi = m.ttft_ms_p95_interval
    assert lo <= m.ttft_ms_p95 <= hi < 200 and m.slo_verdict == "PASS" and m.meets_slo
    edge = level_metrics(quick, Slo(ttft_ms=m.ttft_ms_p95, tpot_ms=25))  # the objective inside the interval
    assert edge.meets_slo and edge.slo_verdict == "INCONCLUSIVE"


def test_the_generators_own_stalls_are_timed_and_laid_on_the_requests_in_flight():
    import asyncio
    import time

    from eval.load.loadgen import STALL_S, _ticker, with_stalls

    stalls: list[tuple[float, float]] = []

    async def held() -> tuple[float, float]:
        ticker = asyncio.create_task(_ticker(stalls))
        await asyncio.sleep(0.05)  # on time: no stall
        t0 = time.perf_counter()
        time.sleep(0.3)  # the loop held: no chunk could be read meanwhile
        t1 = time.perf_counter()
        await asyncio.sleep(0.05)
        ticker.cancel()
        return t0, t1

    t0, t1 = asyncio.run(held())
    big = [(fro, to) for fro, to in stalls if to - fro > 0.25]  # a busy machine may add short ones
    assert len(big) == 1, stalls
    (fro, to) = big[0]
    assert fro <= t0 + STALL_S and to >= t1 and 0.28 < to - fro < 0.3 + 0.1
    during = RequestRecord(4, 0, t0 - 0.1, t1 + 0.1, True)
    before = RequestRecord(4, 1, t0 - 0.5, t0 - 0.2, True)
    marked = with_stalls([during, before], stalls)
    assert marked[0].client_stall_ms == pytest.approx(1000 * (to - fro)) and marked[1].client_stall_ms == 0
    assert level_metrics(marked, Slo(200, 25)).client_stall_ms == marked[0].client_stall_ms


def test_a_level_missed_only_with_requests_the_generator_held_up_is_too_close_to_call():
    from eval.load.loadgen import with_stalls
    from eval.quality.stats import Verdict

    slo = Slo(ttft_ms=200, tpot_ms=25)
    level = [_request(8, i, float(i), 0.05, 0.01, 8) for i in range(40)]  # TTFT 50 ms, TPOT 10 ms
    late = [_request(8, i, float(i), 0.6, 0.01, 8) for i in range(10)]  # 10 of 40 at 600 ms: p95 misses
    missed = late + level[10:]
    assert level_metrics(missed, slo).slo_verdict == Verdict.FAIL  # the server's, as far as anyone knows
    # the same 10 with the generator held up 550 ms in their flight: the miss is the measurement's
    held = with_stalls(missed, [(r.start + 0.02, r.start + 0.57) for r in late])
    m = level_metrics(held, slo)
    assert m.slo_verdict == Verdict.INCONCLUSIVE and m.client_held == 10 and m.client_stall_ms == pytest.approx(550)
    # held up as long, but the others miss too: still missed
    slow = [_request(8, i, float(i), 0.3, 0.01, 8) for i in range(10, 40)]
    assert level_metrics(
        with_stalls(late + slow, [(r.start + 0.02, r.start + 0.57) for r in late]), slo
    ).slo_verdict == (Verdict.FAIL)
    # every request held up a little, the level far beyond the objective: missed all the same
    far = [_request(8, i, float(i), 0.6, 0.01, 8) for i in range(40)]
    little = with_stalls(far, [(r.start + 0.1, r.start + 0.13) for r in far])
    assert level_metrics(little, slo).client_held == 40 and level_metrics(little, slo).slo_verdict == Verdict.FAIL
    # a stall that began before a request started (a hook between levels, noticed once the level is under way)
    # did not hold it; one that began in its flight did, to its end
    r = level[10]
    assert with_stalls([r], [(r.start - 0.08, r.start + 0.004)])[0].client_stall_ms == 0
    assert with_stalls([r], [(r.end - 0.03, r.end + 0.5)])[0].client_stall_ms == pytest.approx(30)
