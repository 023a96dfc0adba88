"""The `qeval` command line: one subcommand per stage, plus `run`, `models` and `ui`.

Each prints a human summary and, with --json, one JSON document as its last line. Exit status: 0 ok,
1 a gate that found nothing to ship, 2 bad input or a failed stage.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict
from typing import Annotated
from urllib.parse import urlsplit

import typer

from pipelines import cli_kernels, cli_search, cli_ship, cli_stages
from pipelines.cli_common import (
    ForceOpt,
    JsonOpt,
    ModelOpt,
    PrecisionsOpt,
    ScenariosOpt,
    chosen_builds,
    emit_json,
    err,
    guarded,
    out,
    run_builds,
    tracker_for,
)
from pipelines.core.card import cards as cards_mod
from pipelines.core.card.cards import ModelCard
from pipelines.core.store.searches import with_carried
from pipelines.core.system import logs, progress
from pipelines.core.system.errors import QevalError
from pipelines.core.system.net import redact
from pipelines.present import console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Quantization evaluation pipeline.")


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False) -> None:
    logs.quiet_environment()  # children (quantize, evaluate, the UI server) inherit it
    logs.setup(verbose=verbose, rich_console=err)
    try:
        progress.every_s()  # a bad setting is one line now, not a stage that fails on it later
    except QevalError as e:
        err.print(f"qeval: error: {e}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    # SIGTERM (CI runners, job schedulers) stops qeval as Ctrl-C does: every server and child it started is
    # stopped on the way out and the running stage ends as failed. SIGINT is restored too, for a qeval
    # started in the background by a non-interactive shell, which inherits it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)


def _only(card: ModelCard, precisions: list[str] | None) -> ModelCard:
    """The card restricted to these builds and its baseline (all of them when None)."""
    chosen_builds(card, precisions, [])
    if not precisions:
        return card
    return card.model_copy(
        update={"precisions": [card.gate.baseline, *(p for p in precisions if p != card.gate.baseline)]}
    )


@app.command()
@guarded
def models(as_json: JsonOpt = False) -> None:
    """List the model cards and check that each one is valid."""
    from pipelines.core.framework.demands import survey

    listed, problems = survey()
    out.print(console.cards(listed))
    emit_json({"models": listed, "invalid": problems}, as_json)
    if problems:
        raise QevalError("; ".join(problems))


@app.command()
@guarded
def init(
    source: Annotated[str, typer.Argument(help="a checkpoint folder, or a hub id (owner/name)")],
    name: Annotated[str | None, typer.Option(help="the card's name (default: from the source)")] = None,
    revision: Annotated[str, typer.Option(help="hub revision")] = "main",
    force: Annotated[bool, typer.Option("--force", help="replace a card of that name")] = False,
) -> None:
    """Write a validated model card from a model's config.json, and say what it guessed."""
    from pipelines.scaffold import scaffold, write

    made = scaffold(source, name=name, revision=revision)
    path = write(made, force=force)
    out.print(f"wrote {path}" + (f" and {made.shipped_config}" if made.shipped_config else ""), highlight=False)
    for guess in made.guesses:
        err.print(f"guessed: {guess}", highlight=False)


@app.command()
@guarded
def quantize(
    model: ModelOpt,
    precision: Annotated[
        list[str] | None, typer.Option(help="precision to build; repeat for several (default: all)")
    ] = None,
    samples: Annotated[int | None, typer.Option(min=1, help="calibration samples, overriding the card")] = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Build quantized checkpoints with llm-compressor and prove each one is real."""
    from pipelines.stages.quantize import quantize as run_quantize

    run_builds(model, precision, lambda c: c.precisions, run_quantize, as_json, force=force, num_samples=samples)


@app.command()
@guarded
def evaluate(
    model: ModelOpt,
    precision: Annotated[str | None, typer.Option(help="build to evaluate (default: the baseline)")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="documents per task, for a quick look")] = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Accuracy of one build with lm-evaluation-harness."""
    from pipelines.stages.evaluate import evaluate as run_evaluate

    chosen = [precision] if precision else None
    run_builds(model, chosen, lambda c: [c.gate.baseline], run_evaluate, as_json, force=force, limit=limit)


@app.command()
@guarded
def bench(
    model: ModelOpt,
    precision: PrecisionsOpt = None,
    no_weights: Annotated[
        bool, typer.Option("--no-weights", help="random weights of the baseline's architecture: speed, memory only")
    ] = False,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Generation speed and memory of builds over the card's grid (in-process engine)."""
    from pipelines.stages.bench import bench as run_bench

    def default(card: ModelCard) -> list[str]:
        return [card.gate.baseline] if no_weights else card.precisions

    run_builds(model, precision, default, run_bench, as_json, force=force, no_weights=no_weights)


@app.command()
@guarded
def serve(
    model: ModelOpt,
    precision: PrecisionsOpt = None,
    url: Annotated[
        str | None, typer.Option(help="drive this running OpenAI-compatible server instead of starting one")
    ] = None,
    scenario: Annotated[str | None, typer.Option(help="the card's scenario to sweep (default: its first)")] = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Concurrent users under the card's latency objective, over a real OpenAI-compatible server."""
    from pipelines.stages.serve import serve as run_serve

    if url and (not precision or len(precision) != 1):
        raise QevalError("--url measures one build: name it with exactly one --precision")
    if url and ((u := urlsplit(url)).scheme not in ("http", "https") or not u.hostname or u.query or u.fragment):
        raise QevalError(f"--url must be an http(s) base URL such as http://127.0.0.1:8000, not '{redact(url)}'")
    run_builds(
        model,
        precision,
        lambda c: c.precisions,
        run_serve,
        as_json,
        [scenario] if scenario else None,
        force=force,
        url=url,
    )


@app.command()
@guarded
def shape(
    model: ModelOpt,
    precision: PrecisionsOpt = None,
    scenario: ScenariosOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Every precision's speed at the model's real shape with random weights, on vLLM (no weights needed)."""
    from pipelines.stages.shape import shape as run_shape

    run_builds(model, precision, lambda c: c.precisions, run_shape, as_json, scenario, force=force)


@app.command()
@guarded
def size(
    model: ModelOpt,
    precision: PrecisionsOpt = None,
    gpu: Annotated[list[str] | None, typer.Option(help="catalog GPU; repeat for several (default: all)")] = None,
    batch: Annotated[int | None, typer.Option(min=1, help="concurrent sequences (default: the grid's largest)")] = None,
    input_len: Annotated[int | None, typer.Option(min=1, help="prompt tokens (default: the grid's first)")] = None,
    output_len: Annotated[int | None, typer.Option(min=1, help="output tokens (default: the grid's first)")] = None,
    mbu: Annotated[float, typer.Option(min=0.01, max=1.0, help="bandwidth utilisation decode reaches")] = 1.0,
    log: Annotated[bool, typer.Option("--log", help="also run the size stage for the card's target GPUs")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Will each precision fit each GPU, with how many sequences, how fast? Offline, from the architecture."""
    import eval.devices.gpus as gpus
    from pipelines.stages import size as size_stage

    card = with_carried(cards_mod.load_card(model))
    chosen = chosen_builds(card, precision, card.precisions)
    names = gpu or [g.name for g in gpus.CATALOG]
    grid, a, fits = size_stage.projection(card, chosen, names, batch, input_len, output_len, mbu)
    out.print(console.fits(model, fits, grid, a))
    if log:
        tracker = tracker_for(model)
        for p in chosen:
            size_stage.size(card, p, tracker)
    emit_json({"model": model, "grid": grid, "mbu": mbu, "rows": [asdict(f) for f in fits]}, as_json)


def _gate_outcome(decision, as_json: bool, extra: dict | None = None) -> None:
    """Print the gate's table and decision; exit 1 when nothing ships."""
    out.print(console.gate(decision))
    if decision.chosen:
        reg = decision.registered
        out.print(
            f"ships: {decision.chosen} ({decision.why}); registered as {reg.get('name')} "
            f"version {reg.get('version')}, alias '{reg.get('alias')}'",
            highlight=False,
        )
    else:
        err.print(f"qeval: nothing ships for {decision.model}: {decision.why}", highlight=False)
    emit_json({**(extra or {}), "gate": json.loads(decision.model_dump_json())}, as_json)
    if not decision.chosen:
        raise typer.Exit(1)


@app.command()
@guarded
def run(
    model: ModelOpt = "ref-lm",
    precision: Annotated[
        list[str] | None, typer.Option(help="build to run; repeat for several (default: all; the baseline always)")
    ] = None,
    skip: Annotated[list[str] | None, typer.Option(help="stage to leave out; repeat for several")] = None,
    ray_address: Annotated[
        str | None,
        typer.Option("--ray", help="run each build's stages as one task on this Ray cluster (host:port, or auto)"),
    ] = None,
    speed_half: Annotated[
        bool, typer.Option("--speed-half", help="only the stages that need no weights (shape, size); nothing ships")
    ] = False,
    scenario: ScenariosOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Every stage of the pipeline for one model card, then the gate and the report.

    Exit status 1 when no quantized build passes the gate. A card whose weights cannot be had here runs its
    speed half instead (every precision at the model's shape with random weights, and sizing): nothing is
    gated, nothing ships, and the exit status is 0.
    """
    from pipelines.core.framework.registry import get_stage
    from pipelines.run import run_pipeline

    for stage in skip or []:
        try:
            get_stage(stage)
        except ValueError as e:
            raise QevalError(f"--skip: {e}") from None
    card = _only(cards_mod.load_card(model), precision).with_scenarios(scenario or [])
    result = run_pipeline(
        card, tracker_for(model), force=force, skip=tuple(skip or ()), ray_address=ray_address, speed_half=speed_half
    )
    out.print(console.builds(result.records, result.decision))
    out.print(f"report: {result.report_files[-1]}", highlight=False)
    if result.search is not None:
        out.print(f"search: {result.search.why}", highlight=False)
    out.print(console.time_by_stage(result.seconds), highlight=False)
    extra = {
        "model": model,
        "stages": [r.as_json() for r in result.records],
        "report": [str(p) for p in result.report_files],
        "seconds": {k: round(v, 1) for k, v in result.seconds.items()},
        "search": result.search.model_dump(mode="json") if result.search else None,
    }
    if result.decision is None:
        err.print(f"qeval: nothing judged for {model}: {result.speed_half}", highlight=False)
        emit_json({**extra, "gate": None, "speed_half": result.speed_half}, as_json)
        return
    _gate_outcome(result.decision, as_json, extra)


@app.command()
@guarded
def gate(
    model: ModelOpt,
    against: Annotated[
        str | None,
        typer.Option(help="'ship': also compare every build with the build that ships now (a regression gate)"),
    ] = None,
    precision: Annotated[
        list[str] | None, typer.Option(help="build to judge; repeat for several (default: all the card's)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Decide which quantized build ships, under the card's gate policy (exit 1: none passes).

    Reads the stages from the tracking store where this machine lacks them."""
    from pipelines.decision.gate import gate as run_gate
    from pipelines.present.shipcard import ship_card

    if against not in (None, "ship"):
        raise QevalError(f"--against takes 'ship' (the build alias ship points at), not '{against}'")
    card = _only(with_carried(cards_mod.load_card(model)), precision)
    _gate_outcome(run_gate(card, tracker_for(model), ship_card=ship_card, against=against), as_json)


@app.command()
@guarded
def report(model: ModelOpt, as_json: JsonOpt = False) -> None:
    """Charts and a table of the gate's last decision, speed against quality per precision, to reports/<model>/
    and MLflow."""
    from pipelines.core.store.verdicts import read_decision
    from pipelines.present.report import report as write_report
    from pipelines.tracking.readback import fetch_builds, fetch_decision

    card = with_carried(cards_mod.load_card(model))
    tracker = tracker_for(model)
    fetch_decision(tracker)  # the store's decision, and the stages it judged, where this machine lacks them
    fetch_builds(card, tracker)
    files = write_report(card, read_decision(card.name), tracker)
    for f in files:
        out.print(str(f), highlight=False)
    emit_json({"model": model, "report": [str(f) for f in files]}, as_json)


@app.command()
@guarded
def ui(
    host: Annotated[str, typer.Option(help="address to bind; keep 127.0.0.1 unless you mean to share")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 5000,
    model: Annotated[str | None, typer.Option("--model", "-m", help="print only this model's address")] = None,
) -> None:
    """Browse the runs in the MLflow UI (Ctrl-C stops it); prints each model's runs-table address."""
    from pipelines.ui import serve_ui

    serve_ui(host, port, model, out, err)


# the model registry's commands, the mixed-precision search's, the stage registry's and the kernel table's, in their
# own modules
for _command in (
    cli_ship.pull,
    cli_ship.verify,
    cli_ship.card,
    cli_search.sensitivity,
    cli_search.search,
    cli_stages.stages,
    cli_stages.stage,
    cli_kernels.kernels,
):
    app.command()(_command)
