"""The throughput-interactivity frontier: per build, output tokens/s per instance against the output speed each
user gets, over the levels its sweep measured (with each level's interval), as a chart and, where the card states
a per-user speed (`traffic.user_tps`), every build priced at that speed: what its users would see, not its own
edge (SemiAnalysis' InferenceX compares precisions so; vLLM's `bench sweep` draws the same frontier).

The sweep is the one the capacity table reads (pipelines/present/capacity.py, `measured_sweep`): the serve stage's
of the real checkpoint, else the shape stage's. The speed is interpolated on it (eval/load/capacity.py, `at_speed`);
a build whose every level gave each user more is priced at the best of them, as an upper bound on its cost, and
one whose no level gave each user that much is not priced there, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from eval.load import capacity
from eval.load.serving import LevelMetrics
from pipelines.core.card.cards import ModelCard, Scenario
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Served
from pipelines.core.store.verdicts import CostFigure
from pipelines.present import formats
from pipelines.present.capacity import measured_sweep, traffic_scenario
from pipelines.present.charts import subplots

CHART = "frontier.png"


@dataclass(frozen=True)
class Priced:
    """One build at the card's per-user speed."""

    precision: str
    device: str
    at: capacity.AtSpeed | None  # None: its levels do not bracket the speed (`why`)
    usd_per_mtok: tuple[float, float | None, float | None] | None  # point, and the interval's ends (cheap, dear)
    why: str = ""


Sweeps = dict[str, tuple[str, dict[int, LevelMetrics]]]


def _scenario(card: ModelCard) -> tuple[str, Scenario]:
    """The scenario the frontier is traced in: the traffic's (the card's main one without traffic)."""
    if card.traffic is not None:
        name, sc, _ = traffic_scenario(card)
        return name, sc
    return card.speed.main_scenario


def sweeps(card: ModelCard) -> Sweeps:
    """Per build with a measured sweep in the traffic's scenario (the card's main one without traffic): its
    device and levels."""
    name, sc = _scenario(card)
    found = {p: measured_sweep(card, p, name, sc) for p in card.precisions}
    return {p: (f[0], f[1]) for p, f in found.items() if f and capacity.frontier(f[1])}


def priced(card: ModelCard, swept: Sweeps) -> list[Priced]:
    """Every swept build (`sweeps`) at the card's `traffic.user_tps`; empty where the card states none."""
    if card.traffic is None or card.traffic.user_tps is None:
        return []
    return [_price(card, p, device, levels) for p, (device, levels) in swept.items()]


def _price(card: ModelCard, precision: str, device: str, levels: dict[int, LevelMetrics]) -> Priced:
    """One build at the card's per-user speed on the levels of its sweep on `device`."""
    at = capacity.at_speed(levels, card.traffic.user_tps)
    if at is None:
        best = max(m.output_tps_per_user or 0.0 for _, m in capacity.frontier(levels))
        why = f"no level swept gives each user that much (at most {best:.3g} tokens/s)"
        return Priced(precision, device, None, None, why)
    price = card.traffic.prices.get(device)
    usd = None
    if price is not None and at.output_tps > 0:
        ends = at.output_tps_range
        dear, cheap = (capacity.usd_per_mtok(price, x) if x > 0 else None for x in ends) if ends else (None, None)
        usd = (capacity.usd_per_mtok(price, at.output_tps), cheap, dear)
    return Priced(precision, device, at, usd, "" if price is not None else f"no price for {device} in the card")


def with_speed(card: ModelCard, precision: str, cost: CostFigure | None) -> CostFigure | None:
    """The build's cost figure with its cost at the card's per-user speed added, on the device the figure is
    for (what the gate judges wherever the card states that speed; unchanged where it states none)."""
    if cost is None or card.traffic is None or card.traffic.user_tps is None:
        return cost
    name, sc = _scenario(card)
    found = measured_sweep(card, precision, name, sc)
    if not found or found[0] != cost.device or not capacity.frontier(found[1]):
        # projected: no frontier to read a speed on, so the edge the projection found is what is judged
        why = f"not priced at {card.traffic.user_tps:g} tokens/s per user: no sweep on {cost.device}, its edge judged"
        return replace(cost, at_speed_why=why)
    r = _price(card, precision, found[0], found[1])
    return replace(
        cost,
        user_tps=card.traffic.user_tps,
        at_speed=r.usd_per_mtok,
        at_speed_bound=bool(r.at and r.at.at_least),
        at_speed_why=r.why or None,
        too_slow=r.at is None,
    )


def section(card: ModelCard, swept: Sweeps) -> list[str]:
    """The report's lines: the builds at the card's per-user speed, as a table; empty without one."""
    rows = priced(card, swept)
    if not rows:
        return []
    speed = card.traffic.user_tps if card.traffic else None
    lines = [
        "",
        f"### At {speed:g} output tokens/s per user (matched interactivity)",
        "",
        f"Each build where its users get {speed:g} tokens/s each (1 / median TPOT), interpolated between the two "
        f"levels of its sweep that bracket that speed on the throughput-interactivity frontier ({CHART}); "
        "$ per million output tokens at one instance's throughput there, with the ends of its 95 % interval.",
        "",
        "| build | device | users at that speed | output tokens/s per instance [95% interval] | $ per 1M output "
        "tokens [interval] |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r.at is None:
            lines.append(f"| {r.precision} | {r.device} | - | not priced: {r.why} | - |")
            continue
        ends, least, most = (
            r.at.output_tps_range,
            "at least " if r.at.at_least else "",
            "at most " if r.at.at_least else "",
        )
        tps = f"{least}{r.at.output_tps:.4g}" + (f" [{ends[0]:.4g}, {ends[1]:.4g}]" if ends else "")
        if r.at.at_least:
            tps += f" (every level gave each user more: the best of them, at {r.at.users:g} users)"
        if r.usd_per_mtok is None:
            usd = r.why or "-"
        else:
            point, cheap, dear = r.usd_per_mtok
            usd = f"{most}${point:.3g}" + (f" [${cheap:.3g}, ${dear:.3g}]" if cheap and dear else "")
        users = f"{least}{r.at.users:.0f}" if r.at.at_least else f"{r.at.users:.1f}"
        lines.append(f"| {r.precision} | {r.device} | {users} | {tps} | {usd} |")
    return lines


def figure(card: ModelCard, swept: Sweeps, how: str):
    """Output tokens/s per instance against tokens/s per user, a line per build through its levels (each with
    its interval and its users), the card's per-user speed as a line; emulated builds dashed and hollow."""
    fig, ax = subplots(figsize=(7.5, 4.5))
    for p, (_, levels) in swept.items():
        served = result_of(card.name, p, Served)
        emulated = bool(served and formats.emulated(served.execution))
        points = capacity.frontier(levels)
        xs = [m.output_tps_per_user or 0.0 for _, m in points]
        ys = [m.output_tps or 0.0 for _, m in points]
        errs = [(y - (m.output_tps_lo or y), (m.output_tps_hi or y) - y) for y, (_, m) in zip(ys, points, strict=True)]
        colour = formats.precision_colour(p)
        ax.errorbar(
            xs,
            ys,
            yerr=list(zip(*errs, strict=True)),
            fmt="o--" if emulated else "o-",
            color=colour,
            mfc="none" if emulated else colour,
            capsize=3,
            label=p + (" (emulated)" if emulated else ""),
        )
        for x, y, (c, _) in zip(xs, ys, points, strict=True):
            ax.annotate(str(c), (x, y), xytext=(3, 3), textcoords="offset points", fontsize=7, color=colour)
    if card.traffic is not None and card.traffic.user_tps is not None:
        ax.axvline(card.traffic.user_tps, color="black", lw=1, ls=":")
        ax.annotate(
            f"the card's {card.traffic.user_tps:g} tokens/s per user",
            (card.traffic.user_tps, 1),
            xycoords=("data", "axes fraction"),
            xytext=(4, -12),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_xlabel("output tokens/s per user (1 / median TPOT)")
    ax.set_ylabel("output tokens/s per instance")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title(
        f"{card.name}: throughput against interactivity (numbers: concurrent users; bars: 95 % intervals)\n{how}",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
