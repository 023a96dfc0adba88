"""The capacity and cost table of a card's traffic (`traffic:`), and its Markdown.

Rows are builds, columns device kinds, each cell one build's capacity on one device as pipelines/decision/pricing.py
computes it (the device a sweep ran on, measured; the card's GPUs, projected): the devices the traffic needs within
the scenario's objective, their price per hour, per million output tokens and per request, and whether it was
measured or projected.
"""

from __future__ import annotations

from dataclasses import dataclass

from eval.load.serving import LevelMetrics
from eval.load.speedup import speedup_intervals, speedups
from pipelines.core.card.cards import ModelCard, Slo
from pipelines.core.card.traffic import CPU
from pipelines.core.store import formats
from pipelines.core.store.verdicts import Decision
from pipelines.decision.pricing import Cell, cells_of, traffic_scenario


@dataclass(frozen=True)
class Row:
    precision: str
    cells: dict[str, Cell]
    verdict: str | None  # the gate's, where it ran
    worst: str | None  # the worst task's recovery interval
    crossover: str  # where its throughput against the baseline's crosses 1 in the measured sweep


@dataclass(frozen=True)
class Table:
    scenario: str
    lengths: tuple[int, int]
    slo: Slo
    load: str  # the traffic in words
    devices: list[str]
    rows: list[Row]


def table(card: ModelCard, decision: Decision | None = None) -> Table | None:
    """The card's capacity and cost table, or None where the card states no traffic or nothing was measured
    or sized."""
    t = card.traffic
    if t is None:
        return None
    name, sc, _ = traffic_scenario(card)
    verdicts = {b.precision: b for b in decision.builds} if decision else {}
    rows, devices, sweeps = [], [], {}
    for p in [card.gate.baseline, *(p for p in card.precisions if p != card.gate.baseline)]:
        cells, levels = cells_of(card, p)
        if levels is not None:
            sweeps[p] = levels
        if not cells:
            continue
        devices += [d for d in cells if d not in devices]
        b = verdicts.get(p)
        worst = None
        if b is not None and b.tasks:
            task, c = b.worst_task()
            worst = f"{task} {c.recovery[0]:.4f} [{c.recovery[1]:.4f}, {c.recovery[2]:.4f}]"
        rows.append(Row(p, cells, str(b.verdict) if b else None, worst, _crossover(card, sweeps, p)))
    if not rows:
        return None
    load = f"{t.users} concurrent users at peak" if t.users else f"{t.rate_rps:g} requests/s at peak (Little's law)"
    return Table(name, (sc.input_len, sc.output_len), card.speed.slo_of(sc), load, devices, rows)


def _crossover(card: ModelCard, sweeps: dict[str, dict[int, LevelMetrics]], p: str) -> str:
    base = sweeps.get(card.gate.baseline)
    if p == card.gate.baseline or base is None or p not in sweeps:
        return "-"
    return formats.crossing(speedups(base, sweeps[p]), card.gate.baseline, speedup_intervals(base, sweeps[p]))


def _usd(x: float) -> str:
    """Dollars to three significant figures ($0.0269, $2.50), whole cents from $100."""
    return f"${x:,.2f}" if x >= 100 else f"${x:#.3g}"


def _span(ends: tuple | None, show) -> str:
    """ " [low, high]" of a measured range (the optimistic end first), "" without one."""
    if ends is None or ends[0] == ends[1]:
        return ""
    return " [" + ", ".join(show(x) if x is not None else "none" for x in ends) + "]"


def cell_text(cell: Cell) -> str:
    """One cell: devices, $ per hour, $ per million tokens, $ per 1,000 requests, and whether measured; where
    the users within the objective are a range, the devices and $ per million tokens are ranges too (low to
    high: the optimistic end first)."""
    c, per = cell.cost, cell.per
    if c.instances is None:
        return f"{c.why} ({'measured' if per and per.measured else 'projected'})"
    ends = (cell.bounds[1], cell.bounds[0]) if cell.bounds else None
    unit = "machine" if cell.device == CPU else "GPU"
    many = _span(ends and tuple(e.devices for e in ends), str)
    what = f"{c.devices}{many} {unit}{'s' if c.devices > 1 or many else ''}"
    what += f", TP {per.devices}" if per.devices > 1 else ""
    where = "measured" if per.measured else "projected"
    users = f"{per.users:,}{_span(per.users_range if ends else None, str)} user{'s' if per.users > 1 else ''} each"
    if per.at_least:  # no level missed: the users a lower bound, what rests on them an upper one
        what, users, where = f"at most {what}", f"at least {users}", f"{where}; none missed, stopped at {per.at_least}"
    if c.usd_per_hour is None:
        hours = f"{c.devices} device-hour{'s' if c.devices > 1 else ''} per hour"
        return f"{what} ({users}; {hours}, no price in the card; {where})"
    mtok = _span(ends and tuple(e.usd_per_mtok for e in ends), _usd)
    most = "at most " if per.at_least else ""
    return (
        f"{what} ({users}): {most}{_usd(c.usd_per_hour)}/h, {most}{_usd(c.usd_per_mtok)}{mtok} per 1M output "
        f"tokens, {most}{_usd(1000 * c.usd_per_request)} per 1,000 requests ({where})"
    )


def section(card: ModelCard, tab: Table | None) -> list[str]:
    """The table (table()) as Markdown lines, with how each column's cells were reached; empty without one."""
    if tab is None:
        return []
    slo = tab.slo
    lines = [
        "",
        f"## Capacity and cost: {tab.load}, scenario {tab.scenario} ({tab.lengths[0]} tokens in, {tab.lengths[1]} out)",
        "",
        f"Devices the traffic needs with every user within the objective (TTFT p95 <= {slo.ttft_ms:g} ms, TPOT "
        f"p95 <= {slo.tpot_ms:g} ms); $ per million output tokens and per 1,000 requests at one instance's "
        "highest-throughput load within it. Measured cells come from a sweep on that device, with the range its "
        "levels' intervals leave [optimistic, conservative] (eval/load/capacity.py; choices on cost rest on the "
        "conservative end); projected ones "
        "from the model's bytes and FLOPs (eval/load/capacity.py: "
        f"{card.traffic.projected_mbu:.0%} of peak bandwidth, {card.traffic.projected_mfu:.0%} of peak FLOP/s, "
        "one prompt's prefill as TTFT, no queueing).",
        "",
        "| build | verdict | worst recovery | "
        + " | ".join(tab.devices)
        + " | crossover (output tokens/s against the baseline's at the same users) |",
        "|---|---|---|" + "---|" * len(tab.devices) + "---|",
    ]
    for r in tab.rows:
        cells = [cell_text(r.cells[d]) if d in r.cells else "-" for d in tab.devices]
        lines.append(
            f"| {r.precision} | {r.verdict or '-'} | {r.worst or '-'} | " + " | ".join(cells) + f" | {r.crossover} |"
        )
    hows = {(d, c.per.how) for r in tab.rows for d, c in r.cells.items() if c.per is not None}
    return [*lines, "", *(f"- {d}: {how}" for d in tab.devices for how in sorted({h for e, h in hows if e == d}))]


def columns(tab: Table) -> dict[str, list]:
    """The table as columns for MLflow's log_table: one row per build and device."""
    cols: dict[str, list] = {
        k: []
        for k in (
            "build",
            "device",
            "source",
            "users_per_instance",
            "users_lo",
            "users_hi",
            "users_at_least",
            "devices",
            "usd_per_hour",
            "usd_per_mtok",
            "usd_per_mtok_lo",
            "usd_per_mtok_hi",
            "usd_per_request",
            "why",
        )
    }
    for r in tab.rows:
        for d, cell in r.cells.items():
            c, per = cell.cost, cell.per
            source = "measured" if per and per.measured else "projected"
            users = per.users_range if per and per.users_range and cell.bounds else (None, None)
            usd = (cell.bounds[1].usd_per_mtok, cell.bounds[0].usd_per_mtok) if cell.bounds else (None, None)
            values = (
                r.precision,
                d,
                source,
                per.users if per else 0,
                *users,
                per.at_least if per else None,
                c.devices,
                c.usd_per_hour,
                c.usd_per_mtok,
                *usd,
                c.usd_per_request,
                c.why,
            )
            for k, v in zip(cols, values, strict=True):
                cols[k].append(v)
    return cols
