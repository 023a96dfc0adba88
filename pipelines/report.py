"""The report: the speed-versus-quality picture per precision, as files and in MLflow.

reports/<model>/ gets report.md (the decision at a glance, then every figure, the reasons and how each
was measured) and the charts of pipelines/charts.py: quality against weights and against speed (the
deciding one first, by the policy's `prefer`), server latency against users, engine speed against batch
size, memory. The same charts and the table go to the model's summary run in MLflow (`log_figure`,
`log_table`).
"""

from __future__ import annotations

import io
from pathlib import Path

from eval.sizing import Fit
from pipelines import charts, present
from pipelines.cards import ModelCard
from pipelines.paths import atomic_write, reports_dir
from pipelines.results import BASELINE, Benched, Decision, Served, Sized, finished
from pipelines.tracking import Tracker


def _bench(card: ModelCard, precision: str) -> Benched | None:
    done = finished(card.name, precision, Benched)
    return done.result if done else None


def _served(card: ModelCard, precision: str) -> Served | None:
    done = finished(card.name, precision, Served)
    return done.result if done else None


def _how(card: ModelCard) -> str:
    """How the speed figures the gate uses were measured: the server (its regime) or the engine bench."""
    return _how_served(card) if card.gate.speed_regime == "server" else _how_bench(card)


def _how_bench(card: ModelCard) -> str:
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
        "weights": [],
        "peak": [],
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
        cols["weights"].append(present.size(speed.weights_gb))
        cols["peak"].append(present.size(speed.peak_gb))
        cols["kernels"].append(speed.kernels)
    return cols


def short_table(decision: Decision) -> list[str]:
    """The decision at a glance: one row per build, the figures the gate used."""
    speed = "goodput req/s" if decision.policy.speed_regime == "server" else "decode tok/s per user"
    lines = [
        f"| build | verdict | worst recovery [{decision.policy.confidence:.0%} interval] | weights | {speed} "
        "| users within the SLO | kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [(decision.policy.baseline, "baseline", None, decision.baseline)]
    rows += [(b.precision, b.verdict + (", **ships**" if b.precision == decision.chosen else ""), b, b.speed)
             for b in decision.builds]  # fmt: skip
    for precision, verdict, b, m in rows:
        worst = "1 (reference)"
        if b is not None:
            task, c = b.worst_task()
            worst = f"{c.recovery[0]:.4f} [{c.recovery[1]:.4f}, {c.recovery[2]:.4f}] {task}"
        figure = f"{m.goodput or 0:.3g}" if m.regime == "server" else f"{m.decode_tps:.4g}"
        users = "" if m.users_at_slo is None else str(m.users_at_slo)
        lines.append(f"| {precision} | {verdict} | {worst} | {present.size(m.weights_gb)} | {figure} | {users} "
                     f"| {present.execution(m)} |")  # fmt: skip
    return lines


def slo_limits(card: ModelCard) -> list[str]:
    """Per build, how many users the server held within the SLO and what broke it at the next level."""
    slo, lines = card.speed.slo, []
    for p in card.precisions:
        served = _served(card, p)
        if served is None:
            continue
        missed = next(((c, m) for c, m in sorted(served.per_level.items()) if not m.meets_slo), None)
        if missed is None:
            held = present.users_count(served.max_users_at_slo)
            lines.append(f"- {p}: {held}, every level within the objective ({served.execution})")
            continue
        c, m = missed
        why = []
        if m.ttft_ms_p95 is not None and m.ttft_ms_p95 > slo.ttft_ms:
            why.append(f"TTFT p95 {m.ttft_ms_p95:.0f} ms > {slo.ttft_ms:g} ms")
        if m.tpot_ms_p95 is not None and m.tpot_ms_p95 > slo.tpot_ms:
            why.append(f"TPOT p95 {m.tpot_ms_p95:.1f} ms > {slo.tpot_ms:g} ms")
        if m.failed:
            why.append(f"{m.failed} failed requests")
        if m.bursts:
            why.append(f"{m.bursts} unstreamed (burst) requests")
        held, at = present.users_count(served.max_users_at_slo), present.users_count(c)
        lines.append(f"- {p}: {held}; at {at} {', '.join(why) or 'missed'} ({served.execution})")
    return lines


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
        "total": present.size(f.total_gb),
        "weights": present.size(f.weights_gb),
        "KV cache": present.size(f.kv_gb),
        "max seqs": present.count(f.max_sequences),
        "decode tok/s/user": present.count(f.decode_tps_per_user, cap=100_000),
        "TTFT ms": present.ms(f.ttft_ms),
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
        *short_table(decision),
        "",
        f"Speed is {decision.speed_axis}; kernels: native where the engine runs the format itself, emulated where "
        "it computes in a wider type.",
        "",
        "Policy (model card `gate:`): " + policy_text(decision) + ".",
    ]
    if limits := slo_limits(card):
        slo = card.speed.slo
        title = (
            f"## Users within the latency objective (TTFT p95 <= {slo.ttft_ms:g} ms, TPOT p95 <= {slo.tpot_ms:g} ms)"
        )
        lines += ["", title + ", and what broke it at the next level", "", *limits]
    lines += ["", "## Every figure per build", "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
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
    quality = {
        "quality_vs_weights.png": charts.quality_against(card, decision, "weights", _how(card)),
        "quality_vs_speed.png": charts.quality_against(card, decision, "speed", _how(card)),
    }
    if decision.policy.prefer == "speed":  # the chart of the deciding quantity first
        quality = dict(reversed(quality.items()))
    figures = dict(quality)
    if any(_served(card, p) for p in card.precisions):
        figures["latency_vs_users.png"] = charts.latency_against_users(card, _how_served(card))
    if any(_bench(card, p) for p in card.precisions):
        figures["speed_vs_batch.png"] = charts.speed_against_batch(card, _how_bench(card))
        figures["memory.png"] = charts.memory(card, decision)
    cols = table(card, decision)
    for name, fig in figures.items():
        _save_fig(fig, out / name)
    md = out / "report.md"
    atomic_write(md, markdown(card, decision, cols, list(figures)))
    # MLflow appends a table to the one already logged under that name: each decision's rows carry its time
    history = {"decided": [decision.decided] * len(cols["build"]), **cols}
    tracker.log_report(figures, {"gate_table.json": history}, [md])
    charts.close(figures.values())
    return [out / name for name in figures] + [md]
