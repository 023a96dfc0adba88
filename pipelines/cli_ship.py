"""`qeval pull`, `qeval verify` and `qeval card`: what the registry's alias `ship` points at, delivered and
checked byte for byte against what the gate judged (pipelines/tracking/readback.py). Registered on the
command line by pipelines/cli.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.cli_common import JsonOpt, ModelOpt, emit_json, guarded, out, tracker_for
from pipelines.core.card import cards as cards_mod
from pipelines.core.system.errors import QevalError


@guarded
def pull(
    model: ModelOpt,
    folder: Annotated[str, typer.Argument(help="where to put the build's files (must not exist, or be empty)")],
    alias: Annotated[str, typer.Option(help="registry alias of the version to fetch")] = "ship",
    as_json: JsonOpt = False,
) -> None:
    """Download the build behind a registry alias (default `ship`) from the tracking store: a servable folder."""
    from pipelines.tracking.readback import pull as run_pull

    cards_mod.load_card(model)
    got = run_pull(tracker_for(model), alias, Path(folder))
    out.print(
        f"{got['name']} version {got['version']} ('{alias}', {got['precision']}): {got['files']} files, "
        f"{got['bytes'] / 1e6:.2f} MB in {got['folder']}, {got['verified']} checked against the gated "
        f"checkpoint's sha256",
        highlight=False,
    )
    emit_json(got, as_json)


@guarded
def verify(
    model: ModelOpt,
    folder: Annotated[str, typer.Argument(help="a folder qeval pull wrote, or any copy of a build")],
    as_json: JsonOpt = False,
) -> None:
    """Check a folder's files against the checkpoint of the version alias `ship` points at, byte for byte
    (exit 2: they differ)."""
    from pipelines.tracking.readback import verify as run_verify

    cards_mod.load_card(model)
    tracker = tracker_for(model)
    if (info := tracker.shipped()) is None:
        raise QevalError(f"nothing ships for {model} in the tracking store; run: qeval gate --model {model}")
    if not Path(folder).is_dir():
        raise QevalError(f"{folder} is not a folder")
    checked = run_verify(tracker, info, Path(folder))
    out.print(
        f"{folder}: the {checked} files of version {info['version']} ({info['precision']}) match", highlight=False
    )
    emit_json({"model": model, "version": info["version"], "folder": folder, "verified": checked}, as_json)


@guarded
def card(model: ModelOpt) -> None:
    """Print the ship card of the build alias `ship` points at, from the tracking store."""
    from pipelines.tracking.readback import ship_card

    cards_mod.load_card(model)
    tracker = tracker_for(model)
    if (shipped := tracker.shipped()) is None:
        raise QevalError(f"nothing ships for {model} in the tracking store; run: qeval gate --model {model}")
    text = ship_card(tracker, shipped["run_id"]) or shipped.get("description") or "(no ship card)"
    shown = "".join(c for c in text if c.isprintable() or c in "\n\t")  # the store's text: no escape reaches a terminal
    out.print(shown, markup=False, highlight=False, soft_wrap=True)
