"""What every `qeval` subcommand shares: its consoles, its options, one line and exit status 2 for a
QevalError, the --json document, and the tracking store's handle.
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
from pipelines.core.system.errors import QevalError

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
