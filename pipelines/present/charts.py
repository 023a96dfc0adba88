"""The report's charts (matplotlib figures), drawn from the gate's decision and the builds' finished stages.

Every chart draws a precision in its colour (formats.py) and a verdict as a marker shape;
emulated builds are hollow, natively run ones filled; the build that ships has a ring and the word.
"""

from __future__ import annotations

import textwrap

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from eval.load.speedup import speedups
from eval.quality.stats import Verdict
from pipelines.core.card.cards import ModelCard
from pipelines.core.store import formats
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Benched, ScenarioSweep, Served
from pipelines.core.store.verdicts import Decision, Measured

_GREY = "#555555"


def subplots(*args, **kwargs):
    """plt.subplots on the Agg backend: figures for files, never a screen."""
    matplotlib.use("Agg")
    return plt.subplots(*args, **kwargs)


def pareto(points: list[tuple[str, float, float]]) -> list[str]:
    """Names of the points no other point beats on both axes (x and y, higher is better)."""
    front = []
    for name, x, y in points:
        if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for _, x2, y2 in points):
            front.append(name)
    return front


def _points(decision: Decision) -> list[tuple[str, str, Measured, tuple[float, float, float]]]:
    """(precision, verdict, measured, worst recovery with its interval) per build, the baseline first."""
    rows = [(decision.policy.baseline, Verdict.BASELINE, decision.baseline, (1.0, 1.0, 1.0))]
    return rows + [(b.precision, b.verdict, b.speed, b.worst_task()[1].recovery) for b in decision.builds]


def _marker(ax, x: float, y: float, precision: str, verdict: str, emulated: bool, size: float = 9) -> None:
    colour = formats.precision_colour(precision)
    ax.plot(
        [x],
        [y],
        formats.VERDICT_MARKERS.get(verdict, "o"),
        ms=size,
        mew=2,
        color=colour,
        markerfacecolor="white" if emulated else colour,
        zorder=4,
    )


def _verdict_handles(decision: Decision) -> list[Line2D]:
    """A legend entry per marker shape the chart shows: the verdicts."""
    shown = {b.verdict for b in decision.builds} | {Verdict.BASELINE}
    return [
        Line2D([], [], ls="", marker=formats.VERDICT_MARKERS.get(v, "o"), color=_GREY, ms=7, label=v.lower())
        for v in formats.VERDICT_MARKERS
        if v in shown
    ]


def _legend(ax, decision: Decision, frontier: bool) -> None:
    """What the shapes and fills mean (the colours are named by each point's label)."""
    handles = _verdict_handles(decision)
    handles += [
        Line2D([], [], ls="", marker="o", color=_GREY, markerfacecolor="white", mew=2, ms=7, label="hollow: emulated"),
        Line2D([], [], ls="", marker="o", color=_GREY, ms=15, markerfacecolor="none", mew=1.5, label="ring: ships"),
    ]
    if frontier:
        handles.append(Line2D([], [], ls="--", color="#999999", label="Pareto frontier"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def quality_against(card: ModelCard, decision: Decision, axis: str, how: str):
    """Worst-task recovery (with its paired interval) against weights (`axis` "weights") or the gate's speed
    figure ("speed"): one point per build, the min-recovery line, the shipped build ringed."""
    policy = decision.policy
    fig, ax = subplots(figsize=(8.5, 4.8))
    rows = _points(decision)
    xs = {p: (m.weights_gb * 1e3 if axis == "weights" else m.speed) for p, _, m, _ in rows}
    for i, (precision, verdict, m, (rec, lo, hi)) in enumerate(sorted(rows, key=lambda r: xs[r[0]])):
        x, emulated = xs[precision], formats.emulated(m.execution)
        colour = formats.precision_colour(precision)
        ax.errorbar(
            [x],
            [rec],
            yerr=[[rec - lo], [hi - rec]],
            fmt="none",
            ecolor=colour,
            elinewidth=1.2,
            capsize=4,
            alpha=0.8,
            zorder=3,
        )
        _marker(ax, x, rec, precision, verdict, emulated)
        ships = precision == decision.chosen
        if ships:
            ax.plot([x], [rec], "o", ms=22, markerfacecolor="none", markeredgecolor="black", mew=1.5, zorder=5)
        # labels alternate right-up and right-down by x order, so that neighbours do not collide
        label = precision + (" SHIPS" if ships else "")
        ax.annotate(
            label,
            (x, rec),
            textcoords="offset points",
            xytext=(12, 10 if i % 2 == 0 else -16),
            fontsize=9,
            color=colour,
            fontweight="bold" if ships else "normal",
            zorder=6,
        )
    if axis == "speed":  # higher is better on both axes: the builds nothing beats on both
        front = sorted((xs[p], r[0]) for p, _, _, r in rows if p in pareto([(p, xs[p], r[0]) for p, _, _, r in rows]))
        ax.plot(
            [x for x, _ in front], [y for _, y in front], "--", color="#999999", lw=1, zorder=1, label="Pareto frontier"
        )
    ax.axhline(policy.min_recovery, color=_GREY, lw=0.8, ls=":")
    ax.annotate(
        f"min recovery {policy.min_recovery:g}",
        (0, policy.min_recovery),
        xycoords=("axes fraction", "data"),
        xytext=(4, -11),
        textcoords="offset points",
        fontsize=8,
        color=_GREY,
    )
    deciding = (axis == "weights") == (policy.prefer == "memory")
    if axis == "weights":
        ax.set_xlabel("weights, MB (checkpoint's linear and embedding tensors)")
        title = "quality against weights"
    else:
        ax.set_xlabel(decision.speed_axis)
        title = "quality against speed"
    title += f" (decides the ship: prefer {policy.prefer})" if deciding else ""
    ax.set_ylabel(f"recovery, worst task\n({_interval(policy)})")
    ax.set_title(f"{card.name}: {title}", fontsize=11)
    ax.text(0.0, -0.2, how, transform=ax.transAxes, fontsize=8, color=_GREY)
    ax.margins(x=0.15)
    ax.grid(alpha=0.3)
    _legend(ax, decision, frontier=axis == "speed")
    fig.tight_layout()
    return fig


def cost_against_quality(card: ModelCard, decision: Decision, points: list[tuple[str, str, float, bool]], how: str):
    """Worst-task recovery (with its paired interval) against $ per million output tokens for the card's
    traffic: one point per build and device kind (`points`: precision, device, dollars, measured), measured
    filled and projected hollow, the shipped build's ringed; dollars on a log axis."""
    fig, ax = subplots(figsize=(8.5, 4.8))
    verdicts = {p: (v, rec) for p, v, _, rec in _points(decision)}
    for i, (precision, device, usd, was_measured) in enumerate(sorted(points, key=lambda t: t[2])):
        verdict, (rec, lo, hi) = verdicts[precision]
        colour = formats.precision_colour(precision)
        ax.errorbar(
            [usd],
            [rec],
            yerr=[[rec - lo], [hi - rec]],
            fmt="none",
            ecolor=colour,
            elinewidth=1.0,
            capsize=3,
            alpha=0.7,
            zorder=3,
        )
        _marker(ax, usd, rec, precision, verdict, emulated=not was_measured)
        ships = precision == decision.chosen
        if ships:
            ax.plot([usd], [rec], "o", ms=22, markerfacecolor="none", markeredgecolor="black", mew=1.5, zorder=5)
        ax.annotate(
            f"{precision} on {device}" + (" SHIPS" if ships else ""),
            (usd, rec),
            textcoords="offset points",
            xytext=(10, 9 if i % 2 == 0 else -15),
            fontsize=8,
            color=colour,
            zorder=6,
        )
    ax.axhline(decision.policy.min_recovery, color=_GREY, lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("$ per million output tokens (card's prices), at one instance's best load within the objective")
    ax.set_ylabel(f"recovery, worst task\n({_interval(decision.policy)})")
    title = f"{card.name}: quality against cost" + (
        " (decides the ship: prefer cost)" if decision.policy.prefer == "cost" else ""
    )
    ax.set_title(title, fontsize=11)
    ax.text(0.0, -0.2, how, transform=ax.transAxes, fontsize=8, color=_GREY)
    ax.grid(alpha=0.3, which="both")
    handles = [
        *_verdict_handles(decision),
        Line2D([], [], ls="", marker="o", color=_GREY, ms=7, label="filled: measured on that device"),
        Line2D([], [], ls="", marker="o", color=_GREY, markerfacecolor="white", mew=2, ms=7, label="hollow: projected"),
        Line2D([], [], ls="", marker="o", color=_GREY, ms=15, markerfacecolor="none", mew=1.5, label="ring: ships"),
    ]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def _line(ax, precision: str, points: list[tuple[int, float | None]], emulated: bool) -> None:
    """One build's figure against a step (batch size, users): its colour, dashed where emulated."""
    pts = [(x, y) for x, y in points if y is not None]
    if pts:
        label = precision + (" (emulated)" if emulated else "")
        ax.plot(
            [x for x, _ in pts],
            [y for _, y in pts],
            "o--" if emulated else "o-",
            color=formats.precision_colour(precision),
            label=label,
        )


def _steps(ax, steps: list[int], label: str) -> None:
    """An x axis of the measured steps only, on a log-2 scale (1, 4, 16, not 1.5, 2.5)."""
    ax.set_xlabel(label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(steps, [str(s) for s in steps])
    ax.minorticks_off()
    ax.grid(alpha=0.3)


def _finish(fig, axes, steps: list[int], label: str, title: str, fontsize: int = 10):
    """Two panels over the same measured steps: their axes, the legend on the first, the title."""
    for ax in axes:
        _steps(ax, steps, label)
    if axes[0].get_legend_handles_labels()[0]:  # none where no build was swept (all probed, or not run)
        axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    return fig


def speed_against_batch(card: ModelCard, how: str):
    """Engine bench: decode tokens/s (all users) and TTFT against batch size; emulated builds dashed."""
    fig, (left, right) = subplots(1, 2, figsize=(10, 4))
    for precision in card.precisions:
        bench: Benched | None = result_of(card.name, precision, Benched)
        if bench is None:
            continue
        emulated = formats.emulated(bench.engine.execution)
        for ax, figure in ((left, "decode_tps_total"), (right, "ttft_ms_p50")):
            _line(ax, precision, [(p.batch, getattr(p, figure)) for p in bench.main_points()], emulated)
    left.set_ylabel("decode tokens/s, all users")
    right.set_ylabel("time to first token, ms (median)")
    return _finish(
        fig, (left, right), card.speed.batch_sizes, "batch size", f"{card.name}: engine bench against batch size\n{how}"
    )


def latency_against_users(card: ModelCard, how: str):
    """Server sweep: p95 TTFT and p95 TPOT against concurrent users, with the SLO's lines."""
    fig, (left, right) = subplots(1, 2, figsize=(10, 4))
    slo = card.speed.main_slo
    for precision in card.precisions:
        served: Served | None = result_of(card.name, precision, Served)
        if served is None:
            continue
        for ax, figure in ((left, "ttft_ms_p95"), (right, "tpot_ms_p95")):
            points = [(c, getattr(m, figure)) for c, m in served.per_level.items()]
            _line(ax, precision, points, formats.emulated(served.execution))
    for ax, limit, name in ((left, slo.ttft_ms, "TTFT"), (right, slo.tpot_ms, "TPOT")):
        ax.axhline(limit, color="black", lw=1, ls=":")
        ax.annotate(
            f"objective: {name} p95 <= {limit:g} ms",
            (0, limit),
            xycoords=("axes fraction", "data"),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize=8,
        )
        ax.set_ylabel(f"{name} p95, ms")
        _steps(ax, card.speed.concurrency, "concurrent users")
    left.legend(fontsize=8)
    fig.suptitle(f"{card.name}: server latency against concurrent users\n{how}", fontsize=10)
    fig.tight_layout()
    return fig


def shape_speed(card: ModelCard, scenario: str, sweeps: dict[str, ScenarioSweep], emulated: set[str], how: str):
    """One scenario of the shape stage: TPOT p50 against users, and the speed-up over the baseline against
    users, per precision (random weights at the model's shape; `sweeps` the baseline's first; `emulated` the
    precisions whose kernels emulate the format)."""
    fig, (left, right) = subplots(1, 2, figsize=(10, 4))
    base = sweeps.get(card.gate.baseline)
    for p, sw in sweeps.items():
        _line(left, p, [(c, m.tpot_ms_p50) for c, m in sw.per_level.items()], p in emulated)
        if base is not None:
            _line(right, p, list(speedups(base.per_level, sw.per_level).items()), p in emulated)
    first = next(iter(sweeps.values()))
    left.axhline(first.slo.tpot_ms, color="black", lw=1, ls=":")
    left.set_ylabel("TPOT p50, ms")
    right.axhline(1.0, color="black", lw=1, ls=":")
    right.set_ylabel(f"output tokens/s over {card.gate.baseline}'s")
    probed = [p for p, sw in sweeps.items() if sw.probe is not None]
    note = f"; not swept, too slow at one user: {', '.join(probed)}" if probed else ""
    what = f"scenario {scenario}, {first.load.input_len} tokens in and {first.load.output_len} out"
    title = f"{card.name}: speed at its shape, random weights ({what})\n" + textwrap.fill(how + note, 150)
    return _finish(fig, (left, right), card.speed.concurrency, "concurrent users", title, fontsize=9)


def memory(card: ModelCard, decision: Decision):
    """Weights, KV cache and the measured peak per build, in MB on a log axis (so that a 4 MB part is as
    visible as a 600 MB one), with the policy's memory budget."""
    b = card.gate.speed_batch
    context = card.speed.input_len + card.speed.output_len
    rows = []
    for precision in card.precisions:
        bench: Benched | None = result_of(card.name, precision, Benched)
        if bench is None:
            continue
        point = bench.at(b)
        peak = point.peak_mem_bytes if point and point.peak_mem_bytes else None
        kv = bench.engine.kv_bytes_per_token * b * context
        rows.append((precision, bench.engine.weight_bytes / 1e6, kv / 1e6, peak and peak / 1e6, bench.engine.memory))
    fig, ax = subplots(figsize=(9, 0.9 * len(rows) + 2))
    parts = (("weights", 1, 1.0), ("KV cache", 2, 0.55), ("measured peak", 3, 0.25))
    height = 0.26
    for name, k, alpha in parts:
        for y, row in enumerate(rows):
            value = row[k]
            if value is None:
                continue
            ax.barh(
                y + (k - 2) * height,
                value,
                height=height,
                color=formats.precision_colour(row[0]),
                alpha=alpha,
                label=name if y == 0 else None,
            )
            ax.text(value, y + (k - 2) * height, f" {name} {formats.size(value / 1e3)}", va="center", fontsize=7.5)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel(f"MB (log scale), at batch {b} with {context} tokens of context")
    budget = decision.policy.memory_budget_gb
    if budget:
        ax.axvline(budget * 1e3, color="black", ls=":", lw=1)
        ax.annotate(
            f"budget {formats.size(budget)} (peak)",
            (budget * 1e3, 1),
            xycoords=("data", "axes fraction"),
            xytext=(-4, -12),
            textcoords="offset points",
            ha="right",
            fontsize=8,
        )
    right = max([budget * 1e3 if budget else 0] + [v for r in rows for v in r[1:4] if v])
    ax.set_xlim(right=right * 4)
    ax.invert_yaxis()
    ax.set_title(f"{card.name}: memory per precision", fontsize=11, pad=22)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    if rows:
        fig.text(0.01, 0.01, f"measured peak: {rows[0][4]}", fontsize=8, color=_GREY)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def agreement(card: ModelCard, decision: Decision, task: str):
    """Share of the task's documents whose greedy output still matches the baseline's, token by token, per
    build: a curve that drops early means many outputs depart early, before any score need move."""
    fig, ax = subplots(figsize=(8, 4.5))
    found = [(b.precision, b.generation[task]) for b in decision.builds if task in b.generation]
    steps = range(max([1] + [p + 1 for _, g in found for p in g.departures.positions if p is not None]) + 1)
    for precision, g in found:
        positions, n = g.departures.positions, len(g.departures.positions)
        ax.step(
            list(steps),
            [sum(p is None or p > t for p in positions) / n for t in steps],
            where="post",
            color=formats.precision_colour(precision),
            label=f"{precision} ({g.departures.text()})",
        )
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("generated token")
    ax.set_ylabel(f"share of outputs still equal to {decision.policy.baseline}'s")
    ax.set_title(f"{card.name} {task}: where greedy outputs depart from the baseline's", fontsize=11)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower left")
    fig.text(
        0.01,
        0.01,
        "greedy decoding, offline (transformers), the same documents for every build; tokens by the model's tokenizer",
        fontsize=8,
        color=_GREY,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def close(figures) -> None:
    for fig in figures:
        plt.close(fig)


def _interval(policy) -> str:
    """What drew the recovery intervals drawn: the gate's confidence sequence, or its bootstrap."""
    if policy.verdicts == "sequential":
        return f"confidence sequence, {1 - policy.confidence:.0%} over the builds"
    return f"{policy.confidence:.0%} paired bootstrap interval"
