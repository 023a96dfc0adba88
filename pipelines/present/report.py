"""The report: the speed-versus-quality picture per precision, as files and in MLflow.

reports/<model>/ gets report.md (the decision at a glance, then every figure, the reasons and how each
was measured; the tables are report_tables.py's) and the charts of charts.py: quality against weights and
against speed (the deciding one first, by the policy's `prefer`), server latency against users, engine speed
against batch size, memory. The same charts (the files written, rendered once) and the table go to the model's
summary run in MLflow.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime
from pathlib import Path

from pipelines.core.card.cards import ModelCard
from pipelines.core.framework.tracker import Tracker
from pipelines.core.store import formats
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Benched, Served
from pipelines.core.store.results.ranked import Ranked
from pipelines.core.store.verdicts import Decision
from pipelines.core.system.files import atomic_write
from pipelines.core.system.paths import reports_dir
from pipelines.decision import pricing
from pipelines.present import capacity, charts, frontier, search_section, shipcard, speed_half
from pipelines.present.report_tables import (
    documents_section,
    fits_section,
    flips_section,
    generation_section,
    policy_text,
    served_section,
    short_table,
    slo_limits,
    table,
)

SHIP_CARD = "ship_card.md"
KERNELS = (
    "kernels: native where the engine runs the format on its own units, weight-only where it upcasts low-bit "
    "weights inside the kernel and computes in 16 bits, emulated where it dequantizes them first"
)


def _how(card: ModelCard) -> str:
    """How the speed figures the gate uses were measured: the server (its regime) or the engine bench."""
    return _how_served(card) if card.gate.speed_regime == "server" else _how_bench(card)


def _how_bench(card: ModelCard) -> str:
    base = result_of(card.name, card.gate.baseline, Benched)
    if base is None:
        return "engine bench: not run"
    e = base.engine
    return (
        f"{e.engine} on {e.device_name}, input {base.input_len} / output {base.output_len} tokens, "
        f"median of {base.config.repeats} runs"
    )


def _engine(card: ModelCard) -> str:
    served = result_of(card.name, card.gate.baseline, Served)
    return f"{served.engine} ({served.engine_version or 'engine'})" if served else f"{card.server.engine} engine"


def _how_served(card: ModelCard) -> str:
    served = result_of(card.name, card.gate.baseline, Served)
    if served is None:
        return "server sweep: not run"
    version = f" ({served.engine_version})" if served.engine_version else ""
    device = f" on {served.device_words}" if served.vllm else ""
    return (
        f"{served.engine}{version}{device} server, {card.judged_users} concurrent users, input "
        f"{served.load.input_len} / output {served.load.output_len} tokens, {served.load.requests_per_user} "
        f"requests per user"
    )


def markdown(
    card: ModelCard,
    decision: Decision,
    cols: dict[str, list],
    charts: list[str],
    tab: capacity.Table | None = None,
    swept: pricing.Sweeps | None = None,
) -> str:
    names = list(cols)
    lines = [
        f"# {card.name}: which build ships",
        "",
        f"**Decision:** {decision.chosen or 'nothing ships'} ({decision.why}).",
        "",
        *(
            [f"Its ship card, also the registered version's description: [{SHIP_CARD}]({SHIP_CARD}).", ""]
            if decision.chosen
            else []
        ),
        f"Decided {decision.decided} by `qeval gate` at commit {decision.code.commit[:12]}"
        f"{' with uncommitted changes' if decision.code.dirty else ''} (artifacts/{decision.model}/gate.json).",
        "",
        *short_table(decision),
        "",
        f"Speed is {decision.speed_axis}; {KERNELS}.",
        "",
        "Policy (model card `gate:`): " + policy_text(decision) + ".",
    ]
    if limits := slo_limits(card):
        slo = card.speed.main_slo
        title = (
            f"## Users within the latency objective (TTFT p95 <= {slo.ttft_ms:g} ms, TPOT p95 <= {slo.tpot_ms:g} ms)"
        )
        lines += ["", title + ", and what broke it at the next level", "", *limits]
    lines += ["", "## Every figure per build", "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for i in range(len(cols["build"])):
        lines.append("| " + " | ".join(str(cols[n][i]) for n in names) + " |")
    lines += generation_section(decision)
    lines += flips_section(decision)
    lines += documents_section(decision)
    lines += search_section.section(card)
    lines += fits_section(card)
    lines += capacity.section(card, tab)
    lines += frontier.section(card, swept or {})
    lines += ["", "## Reasons", ""]
    for b in decision.builds:
        lines.append(f"- **{b.precision}: {b.verdict}**")
        lines += [f"  - {r}" for r in b.reasons]
    name, main = card.speed.main_scenario
    slo = card.speed.main_slo
    lines += [
        "",
        "## How these were measured",
        "",
        f"- Speed (the gate's, {decision.speed_axis}): {_how(card)}"
        + ("." if card.gate.speed_regime == "server" else "; decode tokens/s per user = 1 / median time per token."),
        f"- Server: {_engine(card)} over an OpenAI-compatible endpoint, closed-loop load at "
        f"{card.speed.concurrency} concurrent users, {main.input_len} tokens in and {main.output_len} out "
        f"(scenario {name}); SLO TTFT p95 <= {slo.ttft_ms:g} ms and TPOT p95 <= {slo.tpot_ms:g} ms; goodput "
        "counts the requests that met both.",
        "- Recovery: quantized score / baseline score (baseline / quantized for lower-is-better metrics), "
        f"with a paired bootstrap over the same documents ({decision.policy.bootstrap_resamples:,} resamples); "
        "for 0/1 outcomes the exact McNemar p-value is in gate.json.",
        f"- Kernels (column `kernels`): {KERNELS} (the engine bench dequantizes every quantized build; vLLM "
        "reports the kernel it chose, `qeval serve`). Emulated speed says nothing about hardware with native "
        "kernels.",
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
    if any(result_of(card.name, p, Served) for p in card.precisions):
        figures["latency_vs_users.png"] = charts.latency_against_users(card, _how_served(card))
    if swept := pricing.sweeps(card):
        figures[frontier.CHART] = frontier.figure(card, swept, _how_served(card))
    if any(result_of(card.name, p, Benched) for p in card.precisions):
        figures["speed_vs_batch.png"] = charts.speed_against_batch(card, _how_bench(card))
        figures["memory.png"] = charts.memory(card, decision)
    for task in dict.fromkeys(t for b in decision.builds for t in b.generation):
        figures[f"agreement_{task}.png"] = charts.agreement(card, decision, task)
    per_build = {p: [frontier.CHART] for p in swept} if swept else {}
    if card.search and (ranked := result_of(card.name, card.search.target, Ranked)):
        figures[search_section.CHART] = search_section.figure(ranked)
        per_build.setdefault(card.search.target, []).append(search_section.CHART)
    if tab := capacity.table(card, decision):  # once: the section, the chart, the MLflow table, the ship card
        how = f"{tab.load}, scenario {tab.scenario}: the capacity and cost table's priced cells"
        if points := _cost_points(tab):
            figures["quality_vs_cost.png"] = charts.cost_against_quality(card, decision, points, how)
    cols = table(card, decision)
    # MLflow appends a table to the one already logged under that name: each decision's rows carry its time
    history = {"decided": [decision.decided] * len(cols["build"]), **cols}
    tables = {"gate_table.json": history, **_capacity_table(tab, decision.decided)}
    text = markdown(card, decision, cols, list(figures), tab, swept)
    shipped = shipcard.ship_card(card, decision, tab)
    if shipped:
        atomic_write(out / SHIP_CARD, shipped)
    more = [out / SHIP_CARD] if shipped else []
    return _publish(out, figures, text, tables, tracker, more, per_build)


def _cost_points(tab: capacity.Table) -> list[tuple[str, str, float, bool]]:
    """(precision, device, $ per million output tokens, measured) for every priced cell of the capacity table."""
    cells = [(r.precision, c) for r in tab.rows for c in r.cells.values()]
    return [
        (p, c.device, c.cost.usd_per_mtok, bool(c.per and c.per.measured))
        for p, c in cells
        if c.cost.usd_per_mtok is not None
    ]


def _capacity_table(tab: capacity.Table | None, when: str) -> dict[str, dict[str, list]]:
    """The capacity and cost table as MLflow's log_table takes it, where the card states its traffic (each
    logging's rows carry `when`: MLflow appends to the table already logged under that name)."""
    if tab is None:
        return {}
    cols = capacity.columns(tab)
    return {"capacity_table.json": {"logged": [when] * len(cols["build"]), **cols}}


def _publish(
    out: Path,
    figures: dict,
    text: str,
    tables: dict,
    tracker: Tracker,
    more: list[Path] | None = None,
    per_build: dict[str, list[str]] | None = None,
) -> list[Path]:
    """The charts and report.md (and `more` files written) in `out`, logged to the model's summary run, and the
    charts `per_build` names on each build's run too (beside MLflow's own charts of its figures); the files
    written."""
    for name, fig in figures.items():
        _save_fig(fig, out / name)
    charts.close(figures.values())
    md = out / "report.md"
    atomic_write(md, text)
    written = [out / name for name in figures] + [md, *(more or [])]
    own = {p: [out / n for n in names if n in figures] for p, names in (per_build or {}).items()}
    tracker.log_report(tables, written, {p: paths for p, paths in own.items() if paths} or None)
    return written


def speed_report(card: ModelCard, reason: str, tracker: Tracker) -> list[Path]:
    """The speed half's report (present/speed_half.py) in reports/<model>/, logged to the model's summary run."""
    out = reports_dir(card.name)
    out.mkdir(parents=True, exist_ok=True)
    shaped = speed_half.results(card)
    emulated = {p for p, r in shaped.items() if formats.emulated(r.execution)}
    figures = {
        f"speed_at_shape-{name}.png": charts.shape_speed(
            card, name, speed_half.at(shaped, name), emulated, speed_half.how(shaped)
        )
        for name in speed_half.scenario_names(shaped)
    }
    lines = speed_half.section(card, reason) or [f"# {card.name}", "", f"**Nothing ships:** {reason}."]
    tab = capacity.table(card)
    lines += capacity.section(card, tab)
    swept = pricing.sweeps(card)
    lines += frontier.section(card, swept)
    if swept:
        figures[frontier.CHART] = frontier.figure(card, swept, speed_half.how(shaped) if shaped else "")
    lines += ["", *(f"![{n}]({n})" for n in figures), ""]
    now = datetime.now(UTC).isoformat(timespec="seconds")
    per_build = {p: [frontier.CHART] for p in swept}
    return _publish(out, figures, "\n".join(lines), _capacity_table(tab, now), tracker, None, per_build)
