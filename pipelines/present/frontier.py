"""The throughput-interactivity frontier: per build, output tokens/s per instance against the output speed each
user gets, over the levels its sweep measured (with each level's interval), as a chart and, where the card states
a per-user speed (`traffic.user_tps`), a table of every build priced at that speed: what its users would see, not
its own edge (SemiAnalysis' InferenceX compares precisions so; vLLM's `bench sweep` draws the same frontier).

The sweeps and the prices are pipelines/decision/pricing.py's (`sweeps`, `priced`), the ones the gate judges.
"""

from __future__ import annotations

from eval.load import capacity
from pipelines.core.card.cards import ModelCard
from pipelines.core.store import formats
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Served
from pipelines.decision.pricing import Sweeps, priced
from pipelines.present.charts import subplots

CHART = "frontier.png"


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
