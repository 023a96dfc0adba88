"""`qeval sensitivity` and `qeval search`: which layers a build would keep at a wider format, and the cheapest
mixed build that passes (pipelines/search.py). Registered on the command line by pipelines/cli.py."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pipelines.cli_common import ForceOpt, JsonOpt, ModelOpt, emit_json, err, guarded, out, tracker_for
from pipelines.core.card import cards as cards_mod
from pipelines.core.system.errors import QevalError


@guarded
def sensitivity(
    model: ModelOpt,
    precision: Annotated[
        str | None, typer.Option(help="the quantized precision each group is given (default: the card's search target)")
    ] = None,
    samples: Annotated[int | None, typer.Option(min=1, help="calibration samples, overriding the card")] = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Each layer group's cost when it alone is quantized (KL divergence from the baseline), most sensitive first,
    and the frontier of mixed builds it predicts."""
    from pipelines.stages.sensitivity import sensitivity as run_sensitivity

    card = cards_mod.load_card(model)
    if precision is None and card.search is None:
        raise QevalError(
            f"sensitivity: model '{model}' has no search section to take the precision from; pass --precision"
        )
    precision = precision or card.search.target
    r = run_sensitivity(card, precision, tracker_for(model), force=force, samples=samples).result
    table = Table(title=f"{model}: each layer group alone at {precision} ({r.scheme}, round to nearest)")
    for column in ("rank", "layer group", "KL divergence per token (nats)"):
        table.add_column(column, justify="right" if column != "layer group" else "left")
    for i, g in enumerate(r.ranked, 1):
        table.add_row(str(i), g.group, f"{g.kl:.3g}")
    out.print(table)
    out.print(
        f"over {r.tokens:,} calibration tokens; the most sensitive half at once: {r.top_half_kl:.3g} nats, the "
        f"least sensitive half: {r.bottom_half_kl:.3g}",
        highlight=False,
    )
    emit_json(r.model_dump(mode="json"), as_json)


@guarded
def search(model: ModelOpt, force: ForceOpt = False, as_json: JsonOpt = False) -> None:
    """The cheapest mixed-precision build that passes the gate's quality rules, by the card's `search:` section.

    Exit status 1 when no mix passes and the target does not pass as it is (the reason is printed); `qeval run` runs
    the search too, and carries the mix on through bench, size, serve and the gate.
    """
    from pipelines.search import search as run_search

    found = run_search(cards_mod.load_card(model), tracker_for(model), force=force)
    table = Table(title=f"{model}: {found.target} with its most sensitive layer groups at {found.fallback}")
    for column in (
        "groups kept",
        "build",
        "weights MB",
        "predicted KL",
        "worst task recovery [95 % interval]",
        "verdict",
    ):
        table.add_column(column, justify="left" if column in ("build", "verdict") else "right")
    for t in sorted([*found.uniform, *found.tried], key=lambda t: t.weight_bytes):
        kept = "" if t.kept < 0 else str(t.kept)
        kl = "" if t.predicted_kl is None else f"{t.predicted_kl:.3g}"
        worst = "" if t.worst is None else f"{t.worst[0]:.4f} [{t.worst[1]:.4f}, {t.worst[2]:.4f}] {t.worst_task}"
        table.add_row(kept, t.precision, f"{t.weight_bytes / 1e6:.2f}", kl, worst, str(t.verdict))
    out.print(table)
    (out if found.answered else err).print(f"search: {found.why}", highlight=False)
    emit_json(found.model_dump(mode="json"), as_json)
    if not found.answered:
        raise typer.Exit(1)
