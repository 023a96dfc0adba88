"""The command line's tables (Rich): the stages a command ran, `qeval run`'s closing table per build, the
gate's verdicts, the size projection, the model cards.
"""

from __future__ import annotations

from rich.table import Table

from eval.devices.sizing import Assumptions, Fit
from eval.quality.stats import Verdict
from pipelines.core.store.manifests import StageRecord
from pipelines.core.store.verdicts import Decision
from pipelines.core.system import progress
from pipelines.present.report_tables import fit_cells

_VERDICT_COLOUR = {Verdict.PASS: "green", Verdict.FAIL: "red"}


def records(rows: list[StageRecord]) -> Table:
    table = Table(title="stages")
    for col in ("build", "stage", "status", "seconds", "result"):
        table.add_column(col)
    for r in rows:
        table.add_row(f"{r.model}@{r.precision}", r.stage, r.status, f"{r.seconds:.1f}", r.result.headline())
    return table


def builds(rows: list[StageRecord], decision: Decision | None) -> Table:
    """`qeval run`'s closing table: one row per build, each stage's time (or "cached"), the verdict (none
    where only the speed half ran)."""
    stages = list(dict.fromkeys(r.stage for r in rows))
    verdicts = {
        b.precision: b.verdict + (", ships" if b.precision == decision.chosen else "")
        for b in (decision.builds if decision else [])
    }
    model = rows[0].model if rows else (decision.model if decision else "")
    table = Table(title=f"{model}: stages per build (time, or cached when inputs were unchanged)")
    for col in ("build", *stages, "verdict"):
        table.add_column(col)
    for precision in dict.fromkeys(r.precision for r in rows):
        cells = {
            r.stage: progress.duration(r.seconds) if r.status == "done" else "cached"
            for r in rows
            if r.precision == precision
        }
        verdict = verdicts.get(precision, "baseline" if decision else "not gated (speed half)")
        table.add_row(precision, *(cells.get(st, "") for st in stages), verdict)
    return table


def time_by_stage(seconds: dict[str, float]) -> str:
    """`qeval run`'s last line: the wall time of each stage this run (every build together, cache checks
    included), then of the whole run."""
    parts = [f"{stage} {progress.duration(s)}" for stage, s in seconds.items() if stage != "total"]
    return f"time by stage: {', '.join(parts)}; in all {progress.duration(seconds.get('total', 0.0))}"


def gate(decision: Decision) -> Table:
    table = Table(title=f"gate: {decision.model} (baseline {decision.policy.baseline})")
    for col in ("build", "verdict", "rules"):
        table.add_column(col)
    for b in decision.builds:
        colour = _VERDICT_COLOUR.get(b.verdict, "yellow")
        table.add_row(b.precision, f"[{colour}]{b.verdict}[/{colour}]", "\n".join(b.reasons))
    return table


def fits(model: str, rows: list[Fit], grid: dict[str, int], a: Assumptions) -> Table:
    table = Table(
        title=f"{model}: fits on one GPU at batch {grid['batch']}, {grid['input_len']} in / {grid['output_len']} "
        f"out ({a.describe()})"
    )
    cells = [fit_cells(f) for f in rows]
    for col in cells[0] if cells else []:
        table.add_column(col)
    for r in cells:
        table.add_row(*r.values())
    return table


def cards(rows: list[dict]) -> Table:
    table = Table(title="model cards")
    for col in ("name", "source", "precisions", "tasks"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["source"], " ".join(r["precisions"]), " ".join(r["tasks"]))
    return table
