"""The search for the objective's edge (eval/load/edge.py): bisection on concurrency after the grid, by hand and
against a judge whose edge is known, and a real sweep of a loopback server whose first token waits a known
time for every request in flight."""

from __future__ import annotations

import math
import sys
from collections import Counter

import pytest

from eval.load.edge import AT_USERS, EdgeSearch, next_level, too_wide
from eval.load.serving import CLIENT_STALL_SHARE, LevelMetrics, users_interval
from eval.quality.stats import Verdict

P, U, F = Verdict.PASS, Verdict.INCONCLUSIVE, Verdict.FAIL  # met, too close to call, missed


def test_the_next_level_bisects_the_widest_gap_by_hand():
    assert next_level({1: P, 4: P, 16: F}, 1) == 10
    assert next_level({1: P, 4: P, 10: P, 16: F}, 1) == 13
    assert next_level({1: P, 4: P, 10: P, 13: F, 16: F}, 1) == 11
    assert next_level({1: P, 4: P, 10: P, 11: F, 13: F, 16: F}, 1) is None  # 10 met, 11 missed: found
    assert next_level({1: P, 4: P, 10: P, 13: F, 16: F}, 3) is None  # within the tolerance
    assert next_level({1: P, 4: U, 16: F}, 1) == 10  # too close to call: inside the range, both sides narrowed
    assert next_level({1: P, 4: U, 10: U, 16: F}, 1) == 13
    assert next_level({1: U, 4: F}, 1) == 2  # from no user for certain
    assert next_level({1: F, 4: F}, 1) is None  # not even one user: nothing below to look at
    assert next_level({1: P, 4: P, 16: P}, 1) is None  # none missed, and no raise past the grid allowed
    assert next_level({1: P, 4: P, 16: P}, 1, 256) == 32  # none missed: the load doubled past the grid
    assert next_level({1: P, 4: P, 16: U}, 1, 256) == 32  # too close to call is no miss: raised too
    assert next_level({1: P, 4: P, 16: P, 32: P, 64: P}, 1, 100) == 100  # up to the bound
    assert next_level({1: P, 4: P, 16: P, 100: P}, 1, 100) is None  # at the bound: a lower bound, no edge
    assert next_level({1: P, 4: P, 16: P, 32: F}, 1, 256) == 24  # a miss: bisected as within the grid
    assert next_level({1: P, 4: F, 16: P}, 1) == 2  # a level met above one missed does not count


@pytest.mark.parametrize("grid", [(1, 4, 16), (1, 8, 64), (2, 3)])
def test_the_search_finds_a_known_edge_within_its_levels(grid):
    """Against a judge whose users within the objective are `edge` (PASS up to it, FAIL past it), for every
    edge the grid brackets: the range is exactly the edge, in at most ceil(log2(gap)) added levels."""
    for edge in range(0, max(grid)):
        verdicts = {c: P if c <= edge else F for c in grid}
        added = 0
        while (c := next_level(verdicts, 1)) is not None:
            assert c not in verdicts
            verdicts[c] = P if c <= edge else F
            added += 1
        judged = {c: LevelMetrics(requests=1, failed=0, meets_slo=v == P, slo_verdict=v) for c, v in verdicts.items()}
        assert users_interval(judged) == (edge, edge), (grid, edge, verdicts)
        met = max((c for c in grid if c <= edge), default=0)
        missed = min(c for c in grid if c > edge)
        assert added <= math.ceil(math.log2(missed - met)), (grid, edge, added)


@pytest.mark.parametrize("limit", [64, 256])
def test_the_search_past_the_grid_finds_an_edge_beyond_it_or_stops_at_its_bound(limit):
    """A judge whose edge is past the grid's top: doubling then bisection find it exactly, in at most
    log2(limit / top) doublings and log2(limit / 2) bisections; an edge at or past `limit` is not
    found, and the search stops at the limit with every level met (a lower bound)."""
    grid = (1, 4, 16)
    for edge in (16, 17, 31, 32, 40, 63, 64, 100, 255, 300):
        verdicts = {c: P if c <= edge else F for c in grid}
        added = 0
        while (c := next_level(verdicts, 1, limit)) is not None:
            assert c not in verdicts and c <= limit
            verdicts[c] = P if c <= edge else F
            added += 1
        judged = {c: LevelMetrics(requests=1, failed=0, meets_slo=v == P, slo_verdict=v) for c, v in verdicts.items()}
        if edge >= limit:
            assert F not in verdicts.values() and max(verdicts) == limit and users_interval(judged) == (limit, limit)
            continue
        assert users_interval(judged) == (edge, edge), (edge, verdicts)
        # doublings from 16 to the first miss, then a bisection of a gap of at most half the limit
        assert added <= math.ceil(math.log2(limit / 16)) + math.ceil(math.log2(limit / 2)), (edge, added)


def test_a_level_is_sized_on_its_intervals_width():
    assert too_wide((180.0, 230.0), 200.0, 0.1)  # 50 ms wide against 20
    assert not too_wide((190.0, 205.0), 200.0, 0.1)
    assert not too_wide(None, 200.0, 0.1)  # unmeasured: more of the same would not measure it


def test_the_card_section_refuses_what_it_cannot_do():
    from pydantic import ValidationError

    for bad in ({"levels": -1}, {"tolerance": 0}, {"interval_share": 0}, {"max_s": 0}, {"levels": 1000}, {"x": 1}):
        with pytest.raises(ValidationError):
            EdgeSearch(**bad)


def _sweep_stub(tmp_path, search: EdgeSearch, ms_per_user: float, ttft_ms: float) -> dict:
    """A real sweep (eval/load/loadgen.py, pipelines/stages/sweep.py) of the stub over 1, 4 and 16 users, its
    first token waiting `ms_per_user` for every request in flight; the sweep's summary."""
    import eval.load.loadgen as loadgen
    import eval.load.serving as serving
    import eval.load.stream_stub as stream_stub
    from pipelines.core.system.procs import running
    from pipelines.stages import sweep

    cmd = [sys.executable, "-m", stream_stub.__name__, "--port", "{port}", "--ms-per-user", str(ms_per_user)]
    load = loadgen.LoadSettings(
        api="completions",
        concurrency=[1, 4, 16],
        requests_per_user=3,
        warmup=1,
        input_len=1,
        output_len=2,  # two tokens: a TPOT, and no burst rule (more than 2 tokens at once)
        timeout_s=30,
        edge=search,
    )
    slo = serving.Slo(ttft_ms=ttft_ms, tpot_ms=1000)
    seen = sweep.Seen()
    with running(cmd, tmp_path / "stub.log", 60, "the stub endpoint") as url:
        records = sweep.run_levels("stub", url, "stub", load, ["x"] * loadgen.prompts_needed(load), slo, "log", seen)
    ceiling = sweep.GeneratorCeiling(chunks_per_s=1e6, concurrency=1, failed=0)
    return sweep.levels_summary(records, slo, ceiling, seen)


@pytest.mark.integration
@pytest.mark.quiet
def test_a_sweep_finds_the_edge_of_a_server_whose_latency_grows_with_its_users(tmp_path):
    """The stub's first token waits 20 ms per request in flight: 10 users wait 200 ms, 11 wait 220 ms, so
    with TTFT p95 <= 210 ms the edge is 10 users. The grid 1, 4, 16 brackets it; the search finds it, to
    9 or 10 for certain where the stub's own delays leave 10 too close to call."""
    search = EdgeSearch(levels=6, tolerance=1, interval_share=0.1, max_requests_per_user=6, max_s=120)
    summary = _sweep_stub(tmp_path, search, 20, 210)
    levels = summary["per_level"]
    added = sorted(set(levels) - {1, 4, 16})
    lo, hi = summary["users_at_slo_interval"]
    assert lo in (9, 10) and hi == 10, {c: (m.ttft_ms_p95, m.slo_verdict) for c, m in levels.items()}
    assert summary["max_users_at_slo"] in (9, 10)
    assert {10, 11} <= set(added) and len(added) <= search.levels
    assert levels[16].sizing == "missed wholly"
    assert all(m.sizing for m in levels.values())  # each level says why it has its requests
    assert all(m.requests <= c * search.max_requests_per_user for c, m in levels.items())


@pytest.mark.integration
@pytest.mark.quiet
def test_a_sweep_finds_an_edge_past_its_grid_or_says_its_figure_is_a_lower_bound(tmp_path):
    """The stub's first token waits 10 ms per request in flight: with TTFT p95 <= 415 ms the edge is 40 users
    (400 ms, and the stub's own few ms), past the grid 1, 4, 16, which every level meets. The search raises the
    load (32 met, 64 missed) and bisects to the edge. With max_users 32 it stops there, no level missed: the
    figure is at least 32, and says why."""
    search = EdgeSearch(levels=10, tolerance=1, interval_share=0.1, max_requests_per_user=3, max_s=120)
    for attempt in range(2):  # a sweep whose client was held up measured the client, not the stub: once more
        (tmp_path / str(attempt)).mkdir()
        summary = _sweep_stub(tmp_path / str(attempt), search, 10, 415)
        levels = summary["per_level"]
        if max(m.client_stall_ms for m in levels.values()) < CLIENT_STALL_SHARE * 415:
            break
    lo, hi = summary["users_at_slo_interval"]
    # to the user, or a user or two either side on a busy machine: its own ms add to the stub's wait, and a
    # client slow to send its next request leaves fewer requests in flight than users
    assert 38 <= lo <= hi <= 42 and hi - lo <= 2, {c: (m.ttft_ms_p95, m.slo_verdict) for c, m in levels.items()}
    assert {32, 64} <= set(levels) and levels[64].slo_verdict == F and summary["users_bound"] is None

    (tmp_path / "capped").mkdir()
    capped = _sweep_stub(tmp_path / "capped", search.model_copy(update={"max_users": 32}), 10, 415)
    assert set(capped["per_level"]) == {1, 4, 16, 32} and capped["max_users_at_slo"] == 32
    assert capped["users_bound"] == AT_USERS.format(n=32)


@pytest.mark.integration
@pytest.mark.quiet
def test_later_server_starts_sweep_the_levels_the_first_judged(tmp_path):
    """Two starts of the stub (server.starts): the first adds a level toward the edge; the second is a fresh server
    that sweeps the same levels with as many requests, its records numbered by start; the summary judges the
    pooled requests, each level's wall time summed over the starts."""
    import eval.load.loadgen as loadgen
    import eval.load.serving as serving
    import eval.load.stream_stub as stream_stub
    from pipelines.core.system.procs import running
    from pipelines.stages import sweep

    cmd = [sys.executable, "-m", stream_stub.__name__, "--port", "{port}", "--ms-per-user", "20"]
    search = EdgeSearch(levels=1, tolerance=1, interval_share=0.5, max_requests_per_user=3, max_s=60)
    load = loadgen.LoadSettings(
        api="completions", concurrency=[1, 16], requests_per_user=3, warmup=1, input_len=1, output_len=2,
        timeout_s=30, edge=search,
    )  # fmt: skip
    slo, prompts = serving.Slo(ttft_ms=210, tpot_ms=1000), ["x"] * loadgen.prompts_needed(load)
    started = []

    def start(log):
        started.append(log.name)
        return running(cmd, log, 60, "the stub endpoint")

    with start(tmp_path / "server.log") as url:
        first = sweep.run_levels("stub", url, "stub", load, prompts, slo, "log")
    records = sweep.more_starts("stub", 2, start, "stub", load, prompts, slo, tmp_path, first)
    assert started == ["server.log", "server-2.log"]
    by_start = [[(r.concurrency, r.index) for r in records if r.run == k] for k in range(2)]
    assert sorted(by_start[0]) == by_start[1] and {c for c, _ in by_start[0]} == {1, 8, 16}  # 8: the added level
    ceiling = sweep.GeneratorCeiling(chunks_per_s=1e6, concurrency=1, failed=0)
    levels = sweep.levels_summary(records, slo, ceiling)["per_level"]
    assert {c: m.requests for c, m in levels.items()} == {
        c: 2 * n for c, n in Counter(c for c, _ in by_start[0]).items()
    }
    assert levels[16].slo_verdict == Verdict.FAIL and levels[1].slo_verdict == Verdict.PASS


@pytest.mark.integration
@pytest.mark.quiet
@pytest.mark.parametrize(
    ("max_s", "per_user", "says"),
    [(120, 6, "stopped at the card's 6 requests per user"), (0.001, 3, "stopped at the card's 0.001 s for a sweep")],
)
def test_a_level_gets_more_requests_while_its_interval_is_wide_within_the_cards_bounds(tmp_path, max_s, per_user, says):
    """An interval share no level reaches: every level is given rounds up to the card's requests per user, or
    none past its first where the card's time is spent (the grid still runs whole), and says which; no level
    is added where the grid finds no edge and the card raises the load no further."""
    search = EdgeSearch(levels=3, interval_share=1e-6, max_requests_per_user=6, max_s=max_s, max_users=16)
    levels = _sweep_stub(tmp_path, search, 5, 1000)["per_level"]
    assert set(levels) == {1, 4, 16}
    for c, m in levels.items():
        assert m.requests == per_user * c and m.sizing == says, (c, m)


def test_the_report_says_the_range_the_levels_added_and_why_each_has_its_requests():
    from eval.load.loadgen import LoadSettings
    from pipelines.core.card.cards import Slo
    from pipelines.core.store.results import GeneratorCeiling, Served
    from pipelines.present.report_tables import users_range

    def judged(v: Verdict, sizing: str) -> LevelMetrics:
        return LevelMetrics(requests=12, failed=0, meets_slo=v == P, slo_verdict=v, sizing=sizing)

    def served(levels: dict[int, LevelMetrics]) -> Served:
        load = LoadSettings(
            api="completions",
            concurrency=[1, 4, 16],
            requests_per_user=3,
            warmup=0,
            input_len=1,
            output_len=2,
            timeout_s=1,
        )
        return Served(
            engine="vllm",
            execution="native",
            load=load,
            slo=Slo(ttft_ms=200, tpot_ms=25),
            per_level=levels,
            max_users_at_slo=8,
            users_at_slo_interval=users_interval(levels),
            failed_requests=0,
            generator_ceiling=GeneratorCeiling(chunks_per_s=1e6, concurrency=1, failed=0),
            generator_bound=False,
        )

    ok, hit = "p95 intervals within 10% of the objective", "missed wholly"
    text = users_range(
        served({1: judged(P, ok), 4: judged(P, ok), 8: judged(U, ok), 10: judged(F, hit), 16: judged(F, hit)})
    )
    assert "4 to 9 users; levels 8, 10 added toward the objective's edge" in text
    assert f"requests per level: {ok} (3 levels); {hit} (2 levels)" in text
    bound = AT_USERS.format(n=16)
    beyond = served({1: judged(P, ok), 4: judged(P, ok), 16: judged(P, ok)}).model_copy(update={"users_bound": bound})
    assert f"at least 16 users (none missed up to 16: the sweep stopped at {bound})" in users_range(beyond)
