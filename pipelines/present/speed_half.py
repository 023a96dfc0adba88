"""The speed half's report: every precision at the model's real shape with random weights (the shape stage),
as Markdown lines and a chart per scenario (chat, RAG, ...): latency and throughput per concurrency, the
speed-up over the baseline and where it crosses 1, decode against the device's bandwidth ceiling, and the
size stage's projections with what the measurement says of them. Every heading and caption says the
figures are random weights'.
"""

from __future__ import annotations

from eval.load.speedup import speedup_intervals, speedups
from pipelines.core.card.cards import ModelCard
from pipelines.core.store import formats
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import AtShape, ScenarioSweep, Sized
from pipelines.present.report_tables import fits_section


def results(card: ModelCard) -> dict[str, AtShape]:
    """Each precision's finished shape stage, the baseline first."""
    order = [card.gate.baseline, *(p for p in card.precisions if p != card.gate.baseline)]
    return {p: r for p in order if (r := result_of(card.name, p, AtShape))}


def scenario_names(shaped: dict[str, AtShape]) -> list[str]:
    """The scenarios swept, in the card's order (the baseline's first)."""
    return list(dict.fromkeys(name for r in shaped.values() for name in r.scenarios))


def at(shaped: dict[str, AtShape], scenario: str) -> dict[str, ScenarioSweep]:
    """Each precision's sweep of one scenario."""
    return {p: r.scenarios[scenario] for p, r in shaped.items() if scenario in r.scenarios}


def how(shaped: dict[str, AtShape]) -> str:
    """How every figure was measured, in one sentence."""
    any_one = next(iter(shaped.values()))
    device = any_one.main.ceiling.device if any_one.main.ceiling else "this machine"
    load = any_one.main.load
    return (
        f"{any_one.weights} ({any_one.shape_config}), {any_one.engine_version} on {device}, "
        f"{formats.arithmetic(any_one.vllm.dtype)}; random token ids "
        f"in, the output length forced and checked on every request, {load.requests_per_user} requests per user "
        f"at each level after a warm-up"
    )


def lengths(sweep: ScenarioSweep) -> str:
    cut = f" ({sweep.capped})" if sweep.capped else ""
    return f"{sweep.load.input_len} tokens in, {sweep.load.output_len} out{cut}"


def _pair(a: float | None, b: float | None) -> str:
    return f"{formats.ms(a) if a is not None else '-'} / {formats.ms(b) if b is not None else '-'}"


def level_rows(shaped: dict[str, AtShape], scenario: str) -> list[str]:
    """One row per precision and concurrency; a probed build one row with its probe's figures."""
    rows = []
    for p, sw in at(shaped, scenario).items():
        r = shaped[p]
        kernels = f"{r.execution}: {r.kernel_names}" if r.kernels else str(r.execution)
        if sw.probe is not None:
            rows.append(
                f"| {p} | {kernels} | 1 (probe, {sw.probe.output_len} tokens) | "
                f"{_pair(sw.probe.ttft_ms, None)} | {_pair(sw.probe.tpot_ms, None)} | - | - | "
                f"0 ({sw.probe.why}) |"
            )
            continue
        for c, m in sw.per_level.items():
            rows.append(
                f"| {p} | {kernels} | {c} | {_pair(m.ttft_ms_p50, m.ttft_ms_p95)} | "
                f"{_pair(m.tpot_ms_p50, m.tpot_ms_p95)} | {_pair(m.e2e_ms_p50, m.e2e_ms_p95)} | "
                f"{m.output_tps or 0:.1f} | {'yes' if m.meets_slo else 'no'} |"
            )
    return rows


def speedup_rows(card: ModelCard, shaped: dict[str, AtShape], scenario: str) -> list[str]:
    """Per quantized precision, output tokens/s over the baseline's at each level, and the crossovers."""
    sweeps = at(shaped, scenario)
    base = sweeps.get(card.gate.baseline)
    if base is None:
        return []
    levels = card.speed.concurrency
    rows = [
        "| build | " + " | ".join(formats.users_count(c) for c in levels) + " | crossover |",
        "|---|" + "---|" * len(levels) + "---|",
    ]
    for p, sw in sweeps.items():
        if p == card.gate.baseline:
            continue
        ups = speedups(base.per_level, sw.per_level)
        cells = [f"{ups[c]:.2f}x" if c in ups else "-" for c in levels]
        where = (
            "not swept (too slow at one user)"
            if sw.probe is not None
            else formats.crossing(ups, card.gate.baseline, speedup_intervals(base.per_level, sw.per_level))
        )
        rows.append(f"| {p} | " + " | ".join(cells) + f" | {where} |")
    return rows


def ceiling_rows(card: ModelCard, shaped: dict[str, AtShape], scenario: str) -> tuple[list[str], list[str]]:
    """Decode at one user against the bandwidth ceiling, per precision; and the findings where the bytes
    and the measurement disagree (fewer bytes per step, yet slower than the baseline)."""
    rows, findings = [], []
    sweeps = at(shaped, scenario)
    base = sweeps.get(card.gate.baseline)
    base_c = base.ceiling if base else None
    for p, sw in sweeps.items():
        c = sw.ceiling
        if c is None:
            continue
        share = f"{c.measured_over_ceiling:.0%}" if c.measured_over_ceiling is not None else "-"
        measured = f"{c.measured_tps:.1f}" if c.measured_tps else "-"
        rows.append(f"| {p} | {formats.size(c.step_bytes / 1e9)} | {c.ceiling_tps:.1f} | {measured} | {share} |")
        compared = base_c is not None and p != card.gate.baseline and c.measured_tps and base_c.measured_tps
        if compared and c.step_bytes < base_c.step_bytes and c.measured_tps < base_c.measured_tps:
            findings.append(
                f"**{p}** reads {c.step_bytes / base_c.step_bytes:.2f}x the baseline's bytes per step, so a "
                f"projection from bytes calls it {base_c.step_bytes / c.step_bytes:.2f}x faster; measured, it "
                f"decodes at {c.measured_tps / base_c.measured_tps:.2f}x the baseline's speed: its kernel, "
                f"not its bytes, sets its speed on {c.device}."
            )
    return rows, findings


def scenario_section(card: ModelCard, shaped: dict[str, AtShape], scenario: str) -> list[str]:
    """One scenario: every level, the speed-ups and crossovers, decode against the ceiling."""
    sweeps = at(shaped, scenario)
    first = next(iter(sweeps.values()))
    slo = first.slo
    lines = [
        f"## Scenario {scenario}: {lengths(first)}",
        "",
        f"Objective: TTFT p95 <= {slo.ttft_ms:g} ms and TPOT p95 <= {slo.tpot_ms:g} ms.",
        "",
        "| build | kernels | users | TTFT p50 / p95 ms | TPOT p50 / p95 ms | e2e p50 / p95 ms | output tok/s | "
        "within the objective |",
        "|---|---|---|---|---|---|---|---|",
        *level_rows(shaped, scenario),
    ]
    if ups := speedup_rows(card, shaped, scenario):
        lines += [
            "",
            f"### {scenario}: speed-up over {card.gate.baseline} (output tokens/s at the same users)",
            "",
            *ups,
        ]
    rows, findings = ceiling_rows(card, shaped, scenario)
    if rows:
        lines += [
            "",
            f"### {scenario}: decode at one user against the bandwidth ceiling",
            "",
            "Ceiling: the device's bandwidth over the bytes a decode step reads (weights but the indexed embedding "
            "table, plus the KV cache at mid-generation).",
            "",
            "| build | bytes per step | ceiling tok/s | measured tok/s | measured / ceiling |",
            "|---|---|---|---|---|",
            *rows,
        ]
        lines += ["", *findings] if findings else []
    return lines


def projection_notes(card: ModelCard) -> list[str]:
    """Beside the size stage's projections: what each format reached of its ceiling where it was measured."""
    notes = []
    for p in card.precisions:
        sized = result_of(card.name, p, Sized)
        c = sized.shape_check if sized else None
        if c is not None and c.measured_over_ceiling is not None:
            notes.append(
                f"- {p}: projected at the bandwidth ceiling; on {c.device} this format reached "
                f"{c.measured_over_ceiling:.0%} of its ceiling (random weights at this shape)"
            )
    return notes


def section(card: ModelCard, reason: str | None = None) -> list[str]:
    """The speed half as Markdown lines (empty where no precision was timed at the shape)."""
    shaped = results(card)
    if not shaped:
        return []
    names = scenario_names(shaped)
    lines = [f"# {card.name}: speed at the model's real shape, random weights", ""]
    if reason:
        lines += [f"**Nothing ships:** {reason}.", ""]
    lines += [
        f"Every figure: {how(shaped)}. Scenarios: "
        + "; ".join(f"{n}, {lengths(next(iter(at(shaped, n).values())))}" for n in names)
        + ". These are the format's and the kernels' speed, not any real checkpoint's.",
    ]
    for name in names:
        lines += ["", *scenario_section(card, shaped, name)]
    if fits := fits_section(card):
        lines += [*fits, "", *projection_notes(card)]
    return lines
