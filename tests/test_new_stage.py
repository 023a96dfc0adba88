"""A new stage is its module, its result type (with what it logs to MLflow) and one registry entry: a toy stage
(tests/toy_stage.py), registered here and nowhere else, is listed by `qeval stages`, runs by its name, is cached,
logs to a real MLflow store, and its names are among those qeval says it writes."""

from __future__ import annotations

import json

import pytest
import toy_stage
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.core.framework import registry
from pipelines.core.framework.registry import StageSpec
from pipelines.tracking.store import tracking_uri
from pipelines.tracking.tables import names


def _json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


@pytest.mark.integration
def test_a_stage_is_its_module_its_result_and_one_registry_entry(workdir, monkeypatch):
    entry = StageSpec(
        name="toy",
        result=toy_stage.Counted,
        needs_baseline=False,
        judged=False,
        full_run=False,
        function="toy_stage:toy",
    )
    monkeypatch.setitem(registry.STAGES, "toy", entry)
    monkeypatch.setattr(toy_stage, "WORKED", [])
    cli = CliRunner()

    listed = cli.invoke(app, ["stages", "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = [r for r in _json(listed.output)["stages"] if r["stage"] == "toy"]
    assert row["command"] == "qeval stage toy --model M --precision P" and row["make"] == "make stage STAGE=toy"

    runs = [cli.invoke(app, ["stage", "toy", "--model", "ref-lm", "--precision", "bf16", "--json"]) for _ in "ab"]
    assert [r.exit_code for r in runs] == [0, 0], [r.output for r in runs]
    first, again = (_json(r.output)["stages"][0] for r in runs)
    assert (first["status"], again["status"]) == ("done", "skipped") and toy_stage.WORKED == ["bf16"]
    assert first["result"] == {"layers": 6, "source": "ref-lm"} and first["run_id"] == again["run_id"]
    assert (workdir / "artifacts/ref-lm/bf16/toy/layers.txt").read_text() == "6\n"

    run = MlflowClient(tracking_uri()).get_run(first["run_id"])
    assert run.data.metrics["toy/layers"] == 6 and run.data.params["toy.source"] == "ref-lm"
    assert run.data.tags["qeval.stage.toy"] == "done" and run.info.run_name == "ref-lm@bf16"
    assert "toy/layers" in names()["metrics"] and "toy.source" in names()["params"]

    unknown = cli.invoke(app, ["stage", "toys", "--model", "ref-lm"])
    assert unknown.exit_code == 2 and "unknown stage 'toys'" in unknown.output
