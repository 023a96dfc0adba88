"""The report: the speed-versus-quality picture per precision, as files and in MLflow.

reports/<model>/ gets quality_vs_speed.png (one point per build, Pareto frontier marked),
speed_vs_batch.png, memory.png and report.md (the gate table, how each figure was measured). The same
charts and the table go to the model's summary run in MLflow (`log_figure`, `log_table`).
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt

from eval.sizing import Fit
from pipelines.cards import ModelCard
from pipelines.paths import atomic_write, reports_dir
from pipelines.results import BASELINE, FAIL, INCONCLUSIVE, PASS, Benched, Decision, Served, Sized, finished
from pipelines.tracking import Tracker

COLOURS = {PASS: "#2a9d3f", FAIL: "#c8372d", INCONCLUSIVE: "#e6a117", BASELINE: "#555555"}


def pareto(points: list[tuple[str, float, float]]) -> list[str]:
    """Names of the points no other point beats on both axes (x and y, higher is better)."""
    front = []
    for name, x, y in points:
        if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for _, x2, y2 in points):
            front.append(name)
    return front


def _bench(card: ModelCard, precision: str) -> Benched | None:
    done = finished(card.name, precision, Benched)
    return done.result if done else None


def _served(card: ModelCard, precision: str) -> Served | None:
    done = finished(card.name, precision, Served)
    return done.result if done else None


def _how(card: ModelCard) -> str:
    """How the speed figures the gate uses were measured: the server (its regime) or the engine bench."""
    if card.gate.speed_regime == "server":
        return _how_served(card)
    base = _bench(card, card.gate.baseline)
    if base is None:
        return "engine bench: not run"
    e = base.engine
    return (
        f"{e.engine} on {e.device_name}, input {base.input_len} / output {base.output_len} tokens, "
        f"median of {base.config.repeats} runs"
    )


def _engine(card: ModelCard) -> str:
    served = _served(card, card.gate.baseline)
    return f"{served.engine} ({served.engine_version or 'engine'})" if served else f"{card.server.engine} engine"


def _how_served(card: ModelCard) -> str:
    served = _served(card, card.gate.baseline)
    if served is None:
        return "server sweep: not run"
    version = f" ({served.engine_version})" if served.engine_version else ""
    device = f" on {served.vllm.device}" if served.vllm else ""
    return (
        f"{served.engine}{version}{device} server, {card.judged_users} concurrent users, input "
        f"{served.load.input_len} / output {served.load.output_len} tokens, {served.load.requests_per_user} "
        f"requests per user"
    )


def quality_vs_speed(card: ModelCard, decision: Decision):
    policy = decision.policy
    fig, ax = plt.subplots(figsize=(7.5, 5))
    points = [(policy.baseline, decision.baseline.speed, 1.0)]
    ax.scatter([decision.baseline.speed], [1.0], s=70, color=COLOURS[BASELINE], zorder=3)
    ax.annotate(f"{policy.baseline} (baseline)", (decision.baseline.speed, 1.0), textcoords="offset points",
                xytext=(6, 6), fontsize=9)  # fmt: skip
    by_speed = sorted(decision.builds, key=lambda b: b.speed.speed)
    for i, b in enumerate(by_speed):
        task, worst = b.worst_task()
        rec, lo, hi = worst.recovery
        x = b.speed.speed
        points.append((b.precision, x, rec))
        ax.errorbar([x], [rec], yerr=[[rec - lo], [hi - rec]], fmt="o", ms=8, capsize=4,
                    color=COLOURS[b.verdict], zorder=3)  # fmt: skip
        label = f"{b.precision}: {b.verdict}" + (" - ships" if b.precision == decision.chosen else "")
        label += " (emulated)" if b.speed.kernels.startswith("emulated") else ""
        label += f"\n(worst: {task})"
        # alternate above and below, so that neighbours' labels do not overlap
        ax.annotate(
            label, (x, rec), textcoords="offset points", xytext=(14, 18 if i % 2 else -30), fontsize=8.5,
            color=COLOURS[b.verdict], arrowprops={"arrowstyle": "-", "color": COLOURS[b.verdict], "lw": 0.6},
        )  # fmt: skip
    front = sorted((p for p in points if p[0] in pareto(points)), key=lambda p: p[1])
    ax.scatter([p[1] for p in front], [p[2] for p in front], s=240, facecolors="none", edgecolors="#333333",
               linewidths=1, zorder=2, label="Pareto frontier (nothing beats it on both axes)")  # fmt: skip
    ax.plot([p[1] for p in front], [p[2] for p in front], "--", color="#888888", lw=1)
    ax.axhline(policy.min_recovery, color=COLOURS[FAIL], lw=0.8, ls=":", label=f"min recovery {policy.min_recovery:g}")
    emulated = all(b.speed.kernels.startswith("emulated") for b in decision.builds)
    ax.set_xlabel(decision.speed_axis + (" (quantized: emulated)" * emulated))
    ax.set_ylabel(f"recovery, worst task ({policy.confidence:.0%} paired bootstrap interval)")
    ax.set_title(f"{card.name}: quality against speed per precision", fontsize=11)
    ax.text(0.0, -0.16, _how(card), transform=ax.transAxes, fontsize=8, color="#555555")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def speed_vs_batch(card: ModelCard):
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for precision in card.precisions:
        bench = _bench(card, precision)
        points = bench.main_points() if bench else []
        for ax, figure in ((left, "decode_tps_total"), (right, "ttft_ms_p50")):
            pts = [(p.batch, getattr(p, figure)) for p in points if getattr(p, figure) is not None]
            if pts:
                ax.plot([b for b, _ in pts], [v for _, v in pts], "o-", label=precision)
    left.set_ylabel("decode tokens/s, all users")
    right.set_ylabel("time to first token, ms (median)")
    for ax in (left, right):
        ax.set_xlabel("batch size")
        ax.set_xscale("log", base=2)
        ax.set_xticks(card.speed.batch_sizes, [str(b) for b in card.speed.batch_sizes])
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(f"{card.name}: speed against batch size ({_how(card)})", fontsize=10)
    fig.tight_layout()
    return fig


def memory_breakdown(card: ModelCard):
    b = card.gate.speed_batch
    context = card.speed.input_len + card.speed.output_len
    rows = []
    for precision in card.precisions:
        bench = _bench(card, precision)
        if bench is None:
            continue
        weights = bench.engine.weight_bytes / 1e9
        kv = bench.engine.kv_bytes_per_token * b * context / 1e9
        point = bench.at(b)
        peak = point.peak_mem_bytes / 1e9 if point and point.peak_mem_bytes else 0.0
        rows.append((precision, weights, kv, max(0.0, peak - weights - kv), bench.engine.memory))
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 2.2))
    names = [r[0] for r in rows]
    left = [0.0] * len(rows)
    for i, (part, colour) in enumerate((("weights", "#3b6ea5"), ("KV cache", "#7fb3d5"), ("rest of peak", "#d5d8dc"))):
        values = [r[1 + i] for r in rows]
        ax.barh(names, values, left=left, color=colour, label=part)
        left = [a + v for a, v in zip(left, values, strict=True)]
    for y, (_, weights, kv, _, _) in enumerate(rows):
        ax.text(left[y], y, f"  weights {weights * 1e3:.4g} MB, KV {kv * 1e3:.3g} MB, peak {left[y]:.3g} GB",
                va="center", fontsize=8)  # fmt: skip
    ax.set_xlim(0, max(left, default=1) * 1.6)
    ax.set_xlabel(f"GB at batch {b}, {context} tokens of context")
    ax.set_title(f"{card.name}: memory per precision", fontsize=11, pad=24)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    if rows:
        fig.text(0.01, 0.01, f"peak: {rows[0][4]}", fontsize=8, color="#555555")
    ax.invert_yaxis()
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def table(card: ModelCard, decision: Decision) -> dict[str, list]:
    """The gate table, one row per build, as columns (for MLflow's log_table and the Markdown file)."""
    cols: dict[str, list] = {"build": [], "verdict": []}
    for task in card.accuracy.tasks:
        cols[f"{task} recovery [interval]"] = []
    users = card.judged_users
    cols |= {
        f"decode tok/s per user, batch {decision.policy.speed_batch}": [],
        f"server goodput req/s, {users} users": [],
        "users at SLO": [],
        "speed-up": [],
        "weights GB": [],
        "peak GB": [],
        "kernels": [],
    }
    base = decision.baseline
    rows = [(decision.policy.baseline, BASELINE, None, base, 1.0)] + [
        (b.precision, b.verdict + (" (ships)" if b.precision == decision.chosen else ""), b, b.speed, b.speedup)
        for b in decision.builds
    ]
    for precision, verdict, b, speed, up in rows:
        cols["build"].append(precision)
        cols["verdict"].append(verdict)
        for task in card.accuracy.tasks:
            c = b.tasks[task] if b else None
            cols[f"{task} recovery [interval]"].append(
                f"{c.recovery[0]:.4f} [{c.recovery[1]:.4f}, {c.recovery[2]:.4f}] {c.verdict}" if c else "1"
            )
        cols[f"decode tok/s per user, batch {decision.policy.speed_batch}"].append(f"{speed.decode_tps:.4g}")
        cols[f"server goodput req/s, {users} users"].append("" if speed.goodput is None else f"{speed.goodput:.3g}")
        cols["users at SLO"].append("" if speed.users_at_slo is None else str(speed.users_at_slo))
        cols["speed-up"].append(f"{up:.2f}x" if up is not None else "")
        cols["weights GB"].append(f"{speed.weights_gb:.4g}")
        cols["peak GB"].append(f"{speed.peak_gb:.4g}")
        cols["kernels"].append(speed.kernels)
    return cols


def policy_text(decision: Decision) -> str:
    g = decision.policy
    parts = [f"baseline {g.baseline}", f"every task's recovery at least {g.min_recovery:g} over the whole "
             f"{g.confidence:.0%} paired interval"]  # fmt: skip
    if g.task_min_recovery:
        parts.append("per task: " + ", ".join(f"{t} {v:g}" for t, v in g.task_min_recovery.items()))
    if g.max_ppl_increase is not None:
        parts.append(f"perplexity tasks: perplexity up by at most {g.max_ppl_increase:.2%}")
    speed = f"at least {g.min_speedup:g}x" if g.min_speedup is not None else "not gated"
    parts.append(f"speed-up in {decision.speed_axis}: {speed}")
    parts.append(f"memory budget: {f'{g.memory_budget_gb:g} GB' if g.memory_budget_gb else 'none'}")
    parts.append(f"prefer {g.prefer} (ties within {g.tie_tolerance:.0%})")
    parts.append(f"paired bootstrap: {g.bootstrap_resamples} resamples, seed {g.bootstrap_seed}")
    return "; ".join(parts)


def fit_cells(f: Fit) -> dict[str, str]:
    """One projected fit as the cells people read (the CLI's size table and the report's)."""
    return {
        "gpu": f.gpu,
        "precision": f.precision,
        "runs": f.execution,
        "fits": "yes" if f.fits else (f"TP {f.tensor_parallel}" if f.tensor_parallel else "no"),
        "total GB": f"{f.total_gb:.1f}",
        "weights GB": f"{f.weights_gb:.2f}",
        "KV GB": f"{f.kv_gb:.2f}",
        "max seqs": str(f.max_sequences),
        "decode tok/s/user": f"{f.decode_tps_per_user:.0f}",
        "TTFT ms": f"{f.ttft_ms:.3g}",
    }


def served_section(card: ModelCard) -> list[str]:
    """Each build's accuracy through its server against its offline accuracy, where the card asks for it;
    a difference whose paired interval excludes 0 is called out."""
    rows, found = [], []
    for p in card.precisions:
        served = _served(card, p)
        if served is None or served.accuracy is None:
            continue
        for task, c in served.accuracy.vs_offline.items():
            est, lo, hi = c.difference
            rows.append(f"| {p} | {task} | {c.metric} | {c.n} | {c.offline:.5g} | {c.served:.5g} | "
                        f"{est:+.2g} [{lo:+.2g}, {hi:+.2g}] | {'**differs**' if c.differs else 'same'} |")  # fmt: skip
            if c.differs:
                found.append(f"{p} {task}")
    if not rows:
        return []
    verdict = f"**Finding:** served accuracy differs from offline for {', '.join(found)}." if found else (
        "Every build scores the same through its server as offline, within the paired interval.")  # fmt: skip
    return [
        "",
        "## Accuracy as served (vLLM) against offline (transformers), same documents",
        "",
        verdict,
        "",
        "| build | task | metric | documents | offline | served | served - offline [interval] | |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def fits_section(card: ModelCard) -> list[str]:
    """The size stage's fits-on table for the card's target GPUs, as Markdown lines."""
    sized = [done.result for p in card.precisions if (done := finished(card.name, p, Sized))]
    rows = [fit_cells(f) for s in sized for f in s.fits if f.gpu in card.target_gpus]
    if not rows:
        return []
    s, names = sized[0], list(rows[0])
    return [
        "",
        f"## Projected fit on the target GPUs (batch {s.batch}, {s.input_len} in / {s.output_len} out; "
        f"{s.assumptions.utilization:.0%} of memory, {s.assumptions.runtime_reserve_gib:g} GiB reserve; decode at "
        f"peak bandwidth, TTFT at peak FLOP/s)",
        "",
        "| " + " | ".join(names) + " |",
        "|" + "---|" * len(names),
        *("| " + " | ".join(r[n] for n in names) + " |" for r in rows),
    ]


def markdown(card: ModelCard, decision: Decision, cols: dict[str, list], charts: list[str]) -> str:
    names = list(cols)
    lines = [
        f"# {card.name}: which build ships",
        "",
        f"**Decision:** {decision.chosen or 'nothing ships'} ({decision.why}).",
        "",
        f"Decided {decision.decided} by `qeval gate` at commit {decision.code.commit[:12]}"
        f"{' with uncommitted changes' if decision.code.dirty else ''} (artifacts/{decision.model}/gate.json).",
        "",
        "Policy (model card `gate:`): " + policy_text(decision) + ".",
        "",
        "| " + " | ".join(names) + " |",
        "|" + "---|" * len(names),
    ]
    for i in range(len(cols["build"])):
        lines.append("| " + " | ".join(str(cols[n][i]) for n in names) + " |")
    lines += fits_section(card)
    lines += ["", "## Reasons", ""]
    for b in decision.builds:
        lines.append(f"- **{b.precision}: {b.verdict}**")
        lines += [f"  - {r}" for r in b.reasons]
    lines += [
        "",
        "## How these were measured",
        "",
        f"- Speed (the gate's, {decision.speed_axis}): {_how(card)}"
        + ("." if card.gate.speed_regime == "server" else "; decode tokens/s per user = 1 / median time per token."),
        f"- Server: {_engine(card)} over an OpenAI-compatible endpoint, closed-loop load at "
        f"{card.speed.concurrency} concurrent users, {card.speed.input_len} tokens in and "
        f"{card.speed.output_len} out; SLO TTFT p95 <= {card.speed.slo.ttft_ms:g} ms and TPOT p95 <= "
        f"{card.speed.slo.tpot_ms:g} ms; goodput counts the requests that met both.",
        "- Recovery: quantized score / baseline score (baseline / quantized for lower-is-better metrics), "
        f"with a paired bootstrap over the same documents ({decision.policy.bootstrap_resamples:,} resamples); "
        "for 0/1 outcomes the exact McNemar p-value is in gate.json.",
        "- Kernels (column `kernels`): native where the engine runs the format itself, emulated where it computes "
        "in a wider type (the engine bench dequantizes every quantized build; vLLM reports the kernel it chose, "
        "`qeval serve-bench`). Emulated speed says nothing about hardware with native kernels.",
        *served_section(card),
        "",
        *[f"![{c}]({c})" for c in charts],
        "",
    ]
    return "\n".join(lines)


def _save_fig(fig, path: Path) -> None:
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110, bbox_inches="tight")
    atomic_write(path, png.getvalue())


def report(card: ModelCard, decision: Decision, tracker: Tracker) -> list[Path]:
    """Write the charts and the table of the gate's decision to reports/<model>/ and log them to MLflow."""
    out = reports_dir(card.name)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "quality_vs_speed.png": quality_vs_speed(card, decision),
        "speed_vs_batch.png": speed_vs_batch(card),
        "memory.png": memory_breakdown(card),
    }
    cols = table(card, decision)
    for name, fig in figures.items():
        _save_fig(fig, out / name)
    md = out / "report.md"
    atomic_write(md, markdown(card, decision, cols, list(figures)))
    # MLflow appends a table to the one already logged under that name: each decision's rows carry its time
    history = {"decided": [decision.decided] * len(cols["build"]), **cols}
    tracker.log_report(figures, {"gate_table.json": history}, [md])
    for fig in figures.values():
        plt.close(fig)
    return [out / name for name in figures] + [md]
