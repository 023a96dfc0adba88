"""The report's section on the mixed-precision search (pipelines/search.py): the ranking's check, every build on
the frontier (predicted before it was built, measured after), the mix chosen or why none was."""

from __future__ import annotations

from pipelines.core.card.cards import ModelCard
from pipelines.core.store.results.ranked import Ranked
from pipelines.core.store.searches import Searched, Tried, current
from pipelines.present import charts

CHART = "sensitivity.png"


def section(card: ModelCard) -> list[str]:
    """Markdown lines, where the card searches and its search has run; else none."""
    found = current(card)
    return lines(found) if found is not None else []


def lines(found: Searched) -> list[str]:
    ratio = found.top_half_kl / found.bottom_half_kl if found.bottom_half_kl > 0 else float("inf")
    by_kept = {c.kept: c for c in found.frontier}
    rows = sorted([*found.uniform, *found.tried], key=lambda t: t.weight_bytes)
    return [
        "",
        f"## Mixed precision: {found.target} with its most sensitive layer groups at {found.fallback}",
        "",
        f"**{'Chosen: ' + found.chosen if found.chosen else 'No mix chosen'}:** {found.why}.",
        "",
        f"Ranking (`qeval sensitivity`): {found.groups} layer groups (q/k/v and gate/up each one, as vLLM fuses "
        f"them), each alone at {found.target} rounded to nearest, by its KL divergence from the baseline on the "
        f"calibration text; most sensitive: {', '.join(found.most_sensitive[:3])}. Its check: the most sensitive "
        f"half quantized at once costs {found.top_half_kl:.3g} nats per token, the least sensitive half "
        f"{found.bottom_half_kl:.3g} ({ratio:.1f}x).",
        "",
        f"The first mix tried keeps {found.first} groups, the fewest whose predicted divergence closes 90 % of the "
        f"gap between the uniform builds; then bisection, the gate's quality verdict the judge: "
        f"{_count(len(found.tried), 'mix')} built of the {found.max_evaluations} the card allows."
        if found.first is not None
        else "No mix was built.",
        "",
        "| groups kept | build | weights MB (projected) | bits per weight | predicted KL | worst task recovery "
        "[95 % interval] | verdict |",
        "|---|---|---|---|---|---|---|",
        *(_row(t, by_kept.get(t.kept) if t.kept >= 0 else None) for t in rows),
        "",
        "Predicted: every weight of the mix rounded to nearest, activations left unquantized (the proxy, before "
        "anything is built); measured: the real build (GPTQ or SmoothQuant's errors, activations quantized), "
        "judged like every build. The chart `sensitivity.png` draws the whole predicted frontier.",
    ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 'es' if noun.endswith('x') else 's'}"


def _row(t: Tried, predicted) -> str:
    kept = "" if t.kept < 0 else str(t.kept)
    projected = f" ({predicted.weight_bytes / 1e6:.2f})" if predicted else ""
    bits = f"{predicted.effective_bits:.2f}" if predicted else ""
    kl = f"{t.predicted_kl:.3g}" if t.predicted_kl is not None else ""
    worst = f"{t.worst[0]:.4f} [{t.worst[1]:.4f}, {t.worst[2]:.4f}] {t.worst_task}" if t.worst else ""
    return f"| {kept} | {t.precision} | {t.weight_bytes / 1e6:.2f}{projected} | {bits} | {kl} | {worst} | {t.verdict} |"


def figure(result: Ranked):
    """Two panels: each group's divergence alone, most sensitive first; and the predicted frontier, divergence
    against projected weight bytes, one point per number of groups kept."""
    fig, (left, right) = charts.subplots(1, 2, figsize=(12, 4.5))
    names = [g.group for g in result.ranked]
    left.bar(range(len(names)), [g.kl for g in result.ranked], color="#4c72b0")
    left.set_yscale("log")
    left.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
    left.set_ylabel("KL divergence per token (nats), the group alone quantized")
    left.set_title(f"{result.precision}: layer groups by sensitivity (round to nearest)", fontsize=9)
    xs = [c.weight_bytes / 1e6 for c in result.frontier]
    ys = [max(c.predicted_kl, 1e-9) for c in result.frontier]
    right.plot(xs, ys, "o-", color="#dd8452", ms=3)
    right.set_yscale("log")
    right.set_xlabel("projected weight MB")
    right.set_ylabel("predicted KL divergence (nats)")
    right.set_title(f"predicted frontier: k most sensitive groups at {result.fallback}", fontsize=9)
    for c in (result.frontier[0], result.frontier[-1]):
        right.annotate(c.precision, (c.weight_bytes / 1e6, max(c.predicted_kl, 1e-9)), fontsize=8)
    fig.tight_layout()
    return fig
