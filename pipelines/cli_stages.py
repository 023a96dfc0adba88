"""`qeval stages` and `qeval stage NAME`: the stage registry (pipelines/core/framework/registry.py) on the
command line. Every registered stage is listed and runs by its name, so that a new stage needs no command of its
own; a stage with options of its own (serve's --url, bench's --no-weights) has its own command as well. Registered
on the command line by pipelines/cli.py.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pipelines.cli_common import ForceOpt, JsonOpt, ModelOpt, PrecisionsOpt, emit_json, guarded, out, run_builds
from pipelines.core.framework.registry import STAGES, get_stage
from pipelines.core.system.errors import QevalError


@guarded
def stages(as_json: JsonOpt = False) -> None:
    """List the stages, in the order `qeval run` runs them, with the command that runs each."""
    rows = [
        {
            "stage": s.name,
            "result": s.result.__name__,
            "command": f"qeval {s.command} --model M --precision P",
            "make": f"make {s.make_target}" + (f" STAGE={s.name}" if s.make_target == "stage" else ""),
            "run": "qeval run" if s.full_run else ("the speed half" if not s.needs_weights else "on its own"),
            "judged": s.judged,
        }
        for s in STAGES.values()
    ]
    table = Table(title="stages")
    for col in ("stage", "result", "command", "make", "run", "judged"):
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r[c]) for c in ("stage", "result", "command", "make", "run")), "yes" if r["judged"] else "")
    out.print(table)
    emit_json({"stages": rows}, as_json)


@guarded
def stage(
    name: Annotated[str, typer.Argument(help="a stage of `qeval stages`")],
    model: ModelOpt,
    precision: PrecisionsOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Run one registered stage for builds of a card (default: all of its builds)."""
    try:
        spec = get_stage(name)
    except ValueError as e:
        raise QevalError(str(e)) from None
    run_builds(model, precision, lambda c: c.precisions, spec.load(), as_json, force=force)
