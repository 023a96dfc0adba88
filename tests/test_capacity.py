"""Capacity and cost (eval/load/capacity.py) against cases worked by hand, the card's `traffic:` section, and the
gate's cost rule and `prefer: cost` (pipelines/decision/policy.py) on constructed builds."""

from __future__ import annotations

import math

import pytest
import yaml
from helpers import REPO

from eval.devices.gpus import Gpu
from eval.devices.sizing import Assumptions, Shape
from eval.load.capacity import PerInstance, bounds, cost, measured, project, users_for_rate
from eval.load.serving import LevelMetrics
from eval.quality.stats import Verdict
from pipelines.core.card.cards import Gate, ModelCard
from pipelines.core.card.traffic import Traffic
from pipelines.core.store.verdicts import BuildVerdict, CostFigure, Measured
from pipelines.decision.policy import choose, cost_rule
from quant.execution import Execution

GIB = 2**30


def level(meets: bool, output_tps: float, request_tps: float, e2e_ms: float) -> LevelMetrics:
    return LevelMetrics(
        requests=8, failed=0, meets_slo=meets, output_tps=output_tps, request_tps=request_tps, e2e_ms_p50=e2e_ms
    )


def test_the_cost_of_a_traffic_by_hand():
    # 8 users per instance of 2 GPUs at 400 output tokens/s and 2 requests/s; 20 users at $3 per GPU-hour:
    # ceil(20 / 8) = 3 instances, 6 GPUs, $18/h; an instance-hour is $6, so 6 / (400 x 3600) x 1e6 = $4.1667
    # per million tokens and 6 / (2 x 3600) = $0.000833 per request.
    per = PerInstance(users=8, output_tps=400, request_rps=2, e2e_s=4.0, devices=2, measured=True, how="by hand")
    c = cost(per, 20, 3.0)
    assert (c.instances, c.devices, c.usd_per_hour) == (3, 6, 18.0)
    assert c.usd_per_mtok == pytest.approx(4.1667, abs=1e-4)
    assert c.usd_per_request == pytest.approx(0.000833, abs=1e-6)
    # without a price: the devices (device-hours per hour), no dollars
    free = cost(per, 20, None)
    assert (free.instances, free.devices, free.usd_per_hour, free.usd_per_mtok) == (3, 6, None, None)
    # exactly a multiple: no instance too many
    assert cost(per, 16, 3.0).instances == 2


def test_a_build_that_cannot_serve_says_why_instead_of_dividing_by_zero():
    none = PerInstance(0, 0.0, 0.0, math.inf, 1, True, "by hand")
    assert cost(none, 10, 2.0).why == "holds no user within the objective"
    assert cost(none, 10, 2.0).instances is None
    assert cost(None, 10, 2.0).why == "does not fit on 8 of these"


def test_littles_law_turns_a_rate_into_users():
    assert users_for_rate(2.0, 1.5) == 3.0


def test_a_sweep_holds_the_users_up_to_the_first_level_that_missed():
    sweep = {1: level(True, 50, 1.0, 1000), 4: level(True, 180, 3.0, 1300), 16: level(False, 300, 4.0, 4000)}
    per = measured(sweep, how="by hand")
    assert (per.users, per.output_tps, per.request_rps, per.e2e_s, per.measured) == (4, 180, 3.0, 1.3, True)
    # a level that met the objective above one that missed it does not count
    gap = {1: level(False, 50, 1.0, 1000), 4: level(True, 180, 3.0, 1300)}
    assert measured(gap, how="by hand").users == 0


def test_a_projection_by_hand():
    # One layer, hidden 1000 and intermediate 1000, 10 heads of 100: 7e6 linear parameters and a 1e6 output
    # layer; a KV entry is 2 x 10 x 100 x 2 = 4,000 bytes per token. Weights 1e9 bytes, the embedding table
    # (2e6 bytes) only indexed. 1,000 tokens in, 100 out: a decode step attends to 1,050 tokens. At 50 % of
    # 1e12 bytes/s a step at c users takes (1e9 - 2e6 + c x 4,000 x 1,050) / 5e11 s, within 4 ms while
    # c <= (2e9 - 998e6) / 4.2e6 = 238.57: 238 users.
    shape = Shape(layers=1, hidden=1000, intermediate=1000, heads=10, kv_heads=10, head_dim=100, vocab=1000, tied=False)
    gpu = Gpu(
        "test", "TEST", memory_gib=80, bandwidth=1e12, bf16_flops=1e15, fp8_flops=None, int8_ops=2e15, capability=(8, 0)
    )
    a = Assumptions(mbu=0.5, mfu=0.5)
    per, how = project(shape, "bf16", gpu, weights=1e9, input_len=1000, output_len=100, ttft_ms=1000, tpot_ms=4.0, a=a)
    step = (1e9 - 2e6 + 238 * 4000 * 1050) / 5e11
    assert (per.users, per.devices, per.measured) == (238, 1, False)
    assert per.output_tps == pytest.approx(238 / step)
    # TTFT: 2 x 8e6 x 1,000 + 2 x 1 x 1,000^2 x 10 x 100 = 1.8e10 FLOPs at 5e14 FLOP/s = 36 us
    assert how.ttft_s == pytest.approx(36e-6)
    assert per.e2e_s == pytest.approx(36e-6 + 99 * step)
    # a TTFT objective the prefill cannot meet: no users at all
    slow, _ = project(shape, "bf16", gpu, weights=1e9, input_len=1000, output_len=100, ttft_ms=0.01, tpot_ms=4.0, a=a)
    assert slow.users == 0
    # weights that no 8 of these hold
    assert (
        project(
            shape, "bf16", gpu, weights=8 * 80 * GIB, input_len=1000, output_len=100, ttft_ms=1000, tpot_ms=4.0, a=a
        )
        is None
    )
    # weights that need two: the instance is two GPUs, with twice the bandwidth
    two, _ = project(shape, "bf16", gpu, weights=100e9, input_len=1000, output_len=100, ttft_ms=1000, tpot_ms=102, a=a)
    assert two.devices == 2
    assert two.users == math.floor((102e-3 * 1e12 - (100e9 - 2e6)) / 4.2e6) == 476
    # and never more users than vLLM batches by default on an 80 GiB GPU (1,024), however loose the objective
    loose, _ = project(
        shape, "bf16", gpu, weights=100e9, input_len=1000, output_len=100, ttft_ms=1000, tpot_ms=1000, a=a
    )
    assert loose.users == 1024


def test_the_traffic_section_is_validated():
    assert Traffic(users=64, prices={"h100-sxm": 2.5, "cpu": 0.1}).users == 64
    with pytest.raises(ValueError, match="users or rate_rps"):
        Traffic(users=64, rate_rps=2.0)
    with pytest.raises(ValueError, match="users or rate_rps"):
        Traffic()
    with pytest.raises(ValueError, match=r"not a GPU in the catalog \(did you mean 'h200'\?\)"):
        Traffic(users=1, prices={"h100": 2.5})
    with pytest.raises(ValueError):
        Traffic(users=1, prices={"l4": 0})


@pytest.mark.parametrize(
    "traffic",
    [
        {"rate_rps": math.inf},
        {"rate_rps": 1e-300},
        {"rate_rps": math.nan},
        {"users": 10**30},
        {"users": 4, "prices": {"l4": math.inf}},
        {"users": 4, "prices": {"l4": 1e308}},
        {"users": 4, "prices": {"cpu": 1e-320}},
    ],
)
def test_traffic_figures_are_finite_and_within_bounds_when_the_card_is_read(cards, traffic):
    """`rate_rps: .inf` was an OverflowError, 1e-300 failed the report, a price of 1e308 $/h was registered
    in a ship card as "$6.21e+303 per 1M", 10^30 users a 27-digit device count (issue 41)."""
    from pipelines.core.card.cards import load_card
    from pipelines.core.system.errors import QevalError

    data = yaml.safe_load((REPO / "pipelines/models/ref-lm.yaml").read_text())
    cards("busy", yaml.safe_dump({**data, "name": "busy", "traffic": traffic}))  # .inf, .nan as YAML writes them
    refused = r"busy\.yaml: key 'traffic\.(rate_rps|users|prices\.\w+)': Input should be (less|greater|a finite)"
    with pytest.raises(QevalError, match=refused):
        load_card("busy")


def test_a_card_names_a_scenario_it_has():
    data = yaml.safe_load((REPO / "pipelines/models/ref-lm.yaml").read_text())
    card = ModelCard.model_validate({**data, "traffic": {"users": 4}})
    assert card.traffic.users == 4
    with pytest.raises(ValueError, match=r"traffic\.scenario 'rag' is not among speed\.scenarios"):
        ModelCard.model_validate({**data, "traffic": {"users": 4, "scenario": "rag"}})


def _costed(name: str, weights: float, usd: float | None, why: str | None = None) -> BuildVerdict:
    cost = CostFigure("l4", False, 64, 2, 1.2, usd, why)
    speed = Measured(50.0, weights + 1, weights, Execution.NATIVE, cost=cost)
    return BuildVerdict(precision=name, verdict=Verdict.PASS, rules=[], tasks={}, speed=speed, speedup=None)


def test_prefer_cost_ships_another_build_than_prefer_memory():
    # AWQ has the smallest weights; INT8 serves the traffic for less (its kernels are faster on this device)
    builds = [
        _costed("int8", 8.0, 0.010),
        _costed("awq", 5.0, 0.020),
        _costed("fp8", 8.0, None, "holds no user within the objective"),
    ]
    assert choose(builds, "memory", 0.03)[0] == "awq"
    chosen, why = choose(builds, "cost", 0.03)
    assert chosen == "int8" and "$0.01 per 1M output tokens on l4" in why and "projected" in why
    # within the tie tolerance of the cheapest, the smaller weights win
    assert choose([_costed("int8", 8.0, 0.0100), _costed("awq", 5.0, 0.0102)], "cost", 0.03)[0] == "awq"
    # no passing build with a price there: nothing is chosen, and the reason says why
    none, why = choose([_costed("fp8", 8.0, None, "holds no user within the objective")], "cost", 0.03)
    assert none is None and "has a cost" in why


def _judged(verdict: Verdict, output_tps: float) -> LevelMetrics:
    return LevelMetrics(
        requests=8,
        failed=0,
        meets_slo=verdict != Verdict.FAIL,
        slo_verdict=verdict,
        output_tps=output_tps,
        request_tps=output_tps / 32,
        e2e_ms_p50=1000,
    )


def test_users_within_the_objective_as_a_range_make_cost_a_range_by_hand():
    # met for certain up to 4 users (100 tok/s), 10 too close to call (200 tok/s), 13 missed: 4 to 12 users.
    # 64 users at $0.10 per machine-hour: conservative ceil(64 / 4) = 16 machines at 100 tok/s:
    # 0.10 / (100 x 3600) x 1e6 = $0.2778 per million; optimistic ceil(64 / 12) = 6 machines at 200 tok/s: $0.1389.
    P, U, F = Verdict.PASS, Verdict.INCONCLUSIVE, Verdict.FAIL
    levels = {1: _judged(P, 30), 4: _judged(P, 100), 10: _judged(U, 200), 13: _judged(F, 260)}
    per = measured(levels, how="by hand")
    assert per.users == 10 and per.users_range == (4, 12)  # the point: 10 met on its p95s' point values
    sure, maybe = bounds(levels, per)
    assert (sure.users, sure.output_tps, maybe.users, maybe.output_tps) == (4, 100, 12, 200)
    dear, cheap = cost(sure, 64, 0.10), cost(maybe, 64, 0.10)
    assert (dear.devices, cheap.devices) == (16, 6)
    assert dear.usd_per_mtok == pytest.approx(0.2778, abs=1e-4)
    assert cheap.usd_per_mtok == pytest.approx(0.1389, abs=1e-4)
    # nothing met for certain: the conservative end cannot serve, and says so
    unsure = {1: _judged(U, 30), 4: _judged(F, 100)}
    assert measured(unsure, how="by hand").users_range == (0, 3)
    sure, _ = bounds(unsure, measured(unsure, how="by hand"))
    assert cost(sure, 64, 0.10).why == "holds no user within the objective"
    # levels not judged on intervals: no range
    assert bounds({1: level(True, 50, 1.0, 1000)}, measured({1: level(True, 50, 1.0, 1000)}, how="x")) is None


def test_a_sweep_that_found_no_edge_gives_a_lower_bound_and_costs_at_most():
    """Every level met and the search past the grid stopped at a bound: the users a lower bound, the devices
    and $ that rest on them upper bounds, said so in the table's cell, the gate's figure and its speed line."""
    from pipelines.core.store.formats import speed, users_count
    from pipelines.decision.pricing import Cell
    from pipelines.present.capacity import cell_text

    P = Verdict.PASS
    why = "the card's max_users (64)"
    levels = {1: _judged(P, 30), 4: _judged(P, 100), 16: _judged(P, 300), 64: _judged(P, 900)}
    per = measured(levels, how="by hand", at_least=why)
    assert (per.users, per.at_least) == (64, why)
    c = cost(per, 128, 0.10)
    text = cell_text(Cell("cpu", per, c, 0.10, None))
    assert text.startswith("at most 2 machines (at least 64 users each): at most $0.200/h") and why in text
    figure = CostFigure("cpu", True, 64, 2, 0.2, c.usd_per_mtok, None, at_most=why)
    assert figure.text().startswith("at most $") and why in figure.text()
    speed_line = speed(Measured(50.0, 1.0, 1.0, Execution.NATIVE, "server", users_at_slo=64, users_bound=why))
    assert "at least 64 users within the SLO" in speed_line
    assert users_count(64) == "64 users" and users_count(1, why) == "at least 1 user"


def test_a_build_is_priced_at_the_cards_per_user_speed_on_its_frontier_by_hand():
    """Levels at 1, 4 and 16 users give each user 60, 45 and 20 tokens/s (1 / median TPOT) for 60, 180 and 320
    tokens/s in all. At 40 tokens/s per user: a fifth of the way from 4 users to 16 (45 - 40 = 5 of the 25
    between), so 4 + 0.2 x 12 = 6.4 users and 180 + 0.2 x 140 = 208 tokens/s, its interval likewise; at $0.10 per
    instance-hour, 0.10 / (208 x 3600) x 1e6 = $0.1335 per million. Faster than any level gives: not priced;
    slower than every level: at least the best throughput swept."""
    from eval.load.capacity import at_speed, frontier, usd_per_mtok

    def lv(per_user: float, tps: float) -> LevelMetrics:
        return LevelMetrics(
            requests=8, failed=0, meets_slo=True, output_tps=tps, output_tps_per_user=per_user,
            output_tps_interval=(0.9 * tps, 1.1 * tps),
        )  # fmt: skip

    levels = {16: lv(20, 320), 1: lv(60, 60), 4: lv(45, 180)}
    assert [c for c, _ in frontier(levels)] == [1, 4, 16]  # fastest per user first
    at = at_speed(levels, 40)
    assert at.users == pytest.approx(6.4) and at.output_tps == pytest.approx(208)
    assert at.output_tps_range == pytest.approx((0.9 * 208, 1.1 * 208))
    assert usd_per_mtok(0.10, at.output_tps) == pytest.approx(0.1335, abs=1e-4)
    assert at_speed(levels, 60).users == pytest.approx(1) and at_speed(levels, 20).output_tps == pytest.approx(320)
    assert at_speed(levels, 70) is None  # not even one user gets that much
    slower = at_speed(levels, 10)  # every level gives each user more: the best throughput, a lower bound
    assert slower.at_least and (slower.users, slower.output_tps) == (16, 320)


def test_the_gate_judges_cost_at_the_cards_per_user_speed(monkeypatch):
    """Where the card states `traffic.user_tps`, the gate judges each build's cost at that speed on its frontier:
    int8 is dearer at its own edge (a bigger batch, slower per user) yet cheaper at 40 tokens/s each, where awq's
    users would get less; a build no level of which gives each user that speed fails the cost rule; on a device
    with no sweep (projected) the edge is judged, and the figure says so."""
    from eval.load.capacity import usd_per_mtok
    from pipelines.decision import pricing

    data = yaml.safe_load((REPO / "pipelines/models/ref-lm.yaml").read_text())
    card = ModelCard.model_validate({**data, "gate": {**data["gate"], "prefer": "cost", "cost_on": "cpu"}})

    def lv(per_user: float, tps: float) -> LevelMetrics:
        return LevelMetrics(requests=8, failed=0, meets_slo=True, output_tps=tps, output_tps_per_user=per_user)

    sweeps = {
        "int8": {1: lv(60, 60), 4: lv(50, 200), 16: lv(20, 320)},  # at 40 each: 200 + 120 / 3 = 240 tokens/s
        "awq": {1: lv(45, 45), 4: lv(35, 140), 16: lv(30, 480)},  # at 40: 45 + 95 / 2 = 92.5 tokens/s
        "fp8": {1: lv(10, 10), 4: lv(5, 20)},  # no level gives each user 40
    }
    monkeypatch.setattr(pricing, "measured_sweep", lambda c, p, n, sc: ("cpu", sweeps[p]))
    edge = {"int8": 0.10, "awq": 0.08, "fp8": 0.5}  # at each build's own edge, awq is the cheaper
    builds = []
    for p, at_edge in edge.items():
        figure = pricing.with_speed(card, p, CostFigure("cpu", True, 16, 4, 0.4, at_edge, None))
        speed = Measured(50.0, 2.0, 1.0, Execution.NATIVE, cost=figure)
        builds.append(BuildVerdict(precision=p, verdict=Verdict.PASS, rules=[], tasks={}, speed=speed, speedup=None))
    int8, awq, fp8 = (b.speed.cost for b in builds)
    assert int8.judged == pytest.approx(usd_per_mtok(0.10, 240))
    assert awq.judged == pytest.approx(usd_per_mtok(0.10, 92.5))
    chosen, why = choose(builds, "cost", 0.03)
    assert chosen == "int8" and "at 40 output tokens/s per user: $0.116 per 1M output tokens" in why
    assert fp8.judged is None and fp8.too_slow and "no level swept gives each user that much" in fp8.text()
    bound = Gate(max_cost_per_mtok=0.2)
    assert [cost_rule(bound, b.speed).verdict for b in builds] == [Verdict.PASS, Verdict.FAIL, Verdict.FAIL]
    # projected on the card's first GPU: no frontier there, so its edge is judged, and said so
    projected = pricing.with_speed(card, "int8", CostFigure("h100-sxm", False, 64, 1, 2.5, 0.02, None))
    assert projected.judged == 0.02 and "no sweep on h100-sxm, its edge judged" in projected.text()


def _ranged(name: str, weights: float, usd: tuple[float | None, float | None]) -> BuildVerdict:
    cost = CostFigure("cpu", True, 8, 8, 0.8, usd[0], None, (6, 16), usd)
    speed = Measured(50.0, weights + 1, weights, Execution.NATIVE, cost=cost)
    return BuildVerdict(precision=name, verdict=Verdict.PASS, rules=[], tasks={}, speed=speed, speedup=None)


def test_cost_is_judged_on_the_conservative_end():
    bound = Gate(max_cost_per_mtok=0.20)
    assert cost_rule(bound, _ranged("int8", 8.0, (0.10, 0.15)).speed).verdict == Verdict.PASS
    straddles = cost_rule(bound, _ranged("int8", 8.0, (0.14, 0.28)).speed)
    assert straddles.verdict == Verdict.INCONCLUSIVE and "judged on $0.28, the conservative end" in straddles.reason
    assert cost_rule(bound, _ranged("int8", 8.0, (0.21, 0.28)).speed).verdict == Verdict.FAIL
    assert cost_rule(bound, _ranged("int8", 8.0, (0.14, None)).speed).verdict == Verdict.INCONCLUSIVE
    # the cheaper point, the dearer conservative end: prefer cost takes the other
    chosen, why = choose([_ranged("int8", 8.0, (0.10, 0.30)), _ranged("awq", 5.0, (0.12, 0.20))], "cost", 0.03)
    assert chosen == "awq" and "judged on $0.2" in why


def test_the_cost_rule():
    bound = Gate(max_cost_per_mtok=0.015)
    assert cost_rule(bound, _costed("int8", 8.0, 0.010).speed).verdict == Verdict.PASS
    assert cost_rule(bound, _costed("awq", 5.0, 0.020).speed).verdict == Verdict.FAIL
    none = _costed("fp8", 8.0, None, "holds no user within the objective")
    assert cost_rule(bound, none.speed).verdict == Verdict.FAIL
    assert cost_rule(bound, Measured(50.0, 9.0, 8.0, Execution.NATIVE)).verdict == Verdict.INCONCLUSIVE
    free = cost_rule(Gate(), _costed("int8", 8.0, 0.010).speed)
    assert free.verdict == Verdict.NOT_GATED and "$0.01 per 1M output tokens" in free.reason


def test_judging_cost_needs_a_price_for_the_device():
    data = yaml.safe_load((REPO / "pipelines/models/ref-lm.yaml").read_text())
    cost = {**data["gate"], "prefer": "cost"}
    assert ModelCard.model_validate({**data, "gate": cost}).cost_device == "h100-sxm"  # its first target GPU
    with pytest.raises(ValueError, match="a price for 'a100-80gb'"):
        ModelCard.model_validate({**data, "gate": {**cost, "cost_on": "a100-80gb"}})
    with pytest.raises(ValueError, match="traffic section"):
        ModelCard.model_validate({**{k: v for k, v in data.items() if k != "traffic"}, "gate": cost})
    on_cpu = ModelCard.model_validate({**data, "gate": {**cost, "cost_on": "cpu"}})
    assert on_cpu.cost_device == "cpu" and "cpu" not in on_cpu.sizing_gpus
