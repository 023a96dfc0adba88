"""What every `qeval` subcommand shares: its consoles, its options, one line and exit status 2 for a
QevalError, the --json document, the tracking store's handle, and a stage run for the builds a command names.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any

import typer
from rich.console import Console

from pipelines.core.card import cards as cards_mod
from pipelines.core.card.cards import ModelCard
from pipelines.core.store.manifests import StageRecord
from pipelines.core.store.searches import with_carried
from pipelines.core.system.errors import QevalError
from pipelines.present import console

# Written to a file or a pipe, Rich would cut tables at 80 columns: names a user must type get "…"; wide
# enough, a table keeps its natural width.
out = Console(width=None if sys.stdout.isatty() else 400)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 400)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="model card name (see `qeval models`)")]
ForceOpt = Annotated[bool, typer.Option("--force", help="redo stages even when their inputs are unchanged")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document as the last line")]
PrecisionsOpt = Annotated[list[str] | None, typer.Option(help="build; repeat for several (default: all)")]
ScenariosOpt = Annotated[
    list[str] | None, typer.Option("--scenario", help="the card's speed scenario to sweep; repeat (default: all)")
]


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a QevalError into one line on stderr and exit status 2."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except QevalError as e:
            err.print(f"qeval: error: {e}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("qeval: interrupted (Ctrl-C or SIGTERM); what was running was stopped", highlight=False)
            raise typer.Exit(130) from None

    return wrapper


def emit_json(doc: Any, as_json: bool) -> None:
    if as_json:
        sys.stdout.flush()
        print(json.dumps(doc, default=str), flush=True)


def tracker_for(model: str):
    from pipelines.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker(cards_mod.check_name(model))


def chosen_builds(card: ModelCard, precisions: list[str] | None, default: list[str]) -> list[str]:
    """The builds named (`default` when none are), each checked against the card before any work starts."""
    chosen = precisions or default
    for p in chosen:
        card.require_precision(p)
    return chosen


def report_records(model: str, records: list[StageRecord], as_json: bool) -> None:
    out.print(console.records(records))
    emit_json({"model": model, "stages": [r.as_json() for r in records]}, as_json)


def run_builds(
    model: str,
    precisions: list[str] | None,
    default: Callable[[ModelCard], list[str]],
    stage: Callable[..., StageRecord],
    as_json: bool,
    scenarios: list[str] | None = None,
    **options: Any,
) -> None:
    """Run one stage for the chosen builds of a card (all checked before any work starts)."""
    card = with_carried(cards_mod.load_card(model)).with_scenarios(scenarios or [])
    chosen = chosen_builds(card, precisions, default(card))
    tracker = tracker_for(model)
    report_records(model, [stage(card, p, tracker, **options) for p in chosen], as_json)
