"""The tracker protocol (pipelines/core/framework/tracker.py), one set of tests for both trackers: the MLflow one over
a real store, and the in-memory one the other tests log to. What one does, the other does."""

from __future__ import annotations

from pathlib import Path

import pytest
from memory_tracker import MemoryTracker

from eval.quality.stats import Verdict, compare
from pipelines.core.card.cards import Gate
from pipelines.core.framework.code import code_version
from pipelines.core.framework.tracker import ParamsChanged, Tracker
from pipelines.core.store.manifests import Manifest
from pipelines.core.store.results import Quantized
from pipelines.core.store.verdicts import BuildVerdict, Decision, Measured
from pipelines.tracking.readback import ship_card
from quant.execution import Execution


@pytest.fixture(params=["memory", pytest.param("mlflow", marks=pytest.mark.integration)])
def tracker(request, workdir) -> Tracker:
    if request.param == "memory":
        return MemoryTracker("m")
    from pipelines.tracking.mlflow_tracker import MlflowTracker

    return MlflowTracker("m")


def _manifest(digest: str = "d1", scheme: str = "a", files: dict[str, str] | None = None) -> Manifest:
    result = Quantized(checkpoint="c", checkpoint_bytes=2_000_000, scheme=scheme, files=files)
    return Manifest[Quantized](
        model="m",
        precision="bf16",
        stage="quantize",
        inputs={},
        inputs_digest=digest,
        started="2026-12-01T00:00:00",
        seconds=1.0,
        versions={},
        code=code_version(),
        result=result,
    )


def _stage_folder(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "stage"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    (folder / "stage.log").write_text("a log line\n")
    (folder / "checkpoint" / "model.safetensors").write_bytes(b"weights")
    return sorted(folder.iterdir())


def _checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    return folder


def _decision(policy: Gate) -> Decision:
    m = Measured(100.0, 1.0, 0.5, Execution.NATIVE)
    task = compare("acc", [1.0, 0.0, 1.0], [1.0, 0.0, 1.0], higher_is_better=True)
    build = BuildVerdict(precision="int8", verdict=Verdict.PASS, rules=[], tasks={"t": task}, speed=m, speedup=1.0)
    return Decision(
        model="m",
        decided="2026-12-01T00:00:00",
        policy=policy,
        speed_axis="x",
        baseline=m,
        builds=[build],
        chosen="int8",
        why="the only one",
        code=code_version(),
    )


def test_a_build_has_one_current_run_until_a_new_one_supersedes_it(tracker):
    assert isinstance(tracker, Tracker)
    assert tracker.find_run("bf16") is None and tracker.find_run(None) is None  # creates nothing
    run = tracker.build_run("bf16")
    assert tracker.build_run("bf16") == run == tracker.find_run("bf16")
    assert tracker.build_run("int8") != run
    new = tracker.build_run("bf16", new=True)
    assert new != run and tracker.find_run("bf16") == new


def test_a_logged_stage_is_known_by_its_digest_and_its_files_come_back(tracker, tmp_path):
    run = tracker.build_run("bf16")
    assert tracker.logged_digest(run, "quantize") is None
    tracker.log_stage(run, _manifest("d1"), _stage_folder(tmp_path))
    assert tracker.logged_digest(run, "quantize") == "d1"
    got = tracker.download(run, "quantize", tmp_path / "back", skip=("checkpoint",))
    assert got == tmp_path / "back" / "quantize"
    assert sorted(p.name for p in got.iterdir()) == ["manifest.json", "stage.log"]  # the checkpoint left out
    assert (got / "stage.log").read_text() == "a log line\n"
    assert tracker.has_artifacts(run, "quantize/checkpoint") and not tracker.has_artifacts(run, "bench")
    assert tracker.download(run, "bench", tmp_path / "none") is None
    with pytest.raises(ParamsChanged):  # a param holds another value: the build needs a new run
        tracker.log_stage(run, _manifest("d2", scheme="b"), [])
    # a checkpoint built again with other bytes is another run, so that the version registered from a run's
    # checkpoint is the bytes the gate judged (issue 67)
    built = tracker.build_run("int8")
    tracker.log_stage(built, _manifest("d3", files={"model.safetensors": "a" * 64}), [])
    with pytest.raises(ParamsChanged):
        tracker.log_stage(built, _manifest("d4", files={"model.safetensors": "b" * 64}), [])
    tracker.mark_failed(run, "quantize", "boom")
    assert tracker.logged_digest(run, "quantize") is None  # failed is not done
    assert tracker.describe_failure(RuntimeError("x"))


def test_a_folder_logged_later_is_an_artifact_with_an_address(tracker, tmp_path):
    run = tracker.build_run("awq")
    tracker.log_folder(run, _checkpoint(tmp_path), "quantize/checkpoint")
    assert tracker.has_artifacts(run, "quantize/checkpoint")
    assert tracker.artifact_uri(run, "quantize/checkpoint").endswith("quantize/checkpoint")


def test_the_decision_goes_to_a_summary_run_and_a_changed_policy_starts_another(tracker, tmp_path):
    tracker.build_run("bf16")
    tracker.build_run("int8")
    file = tmp_path / "gate.json"
    file.write_text("{}")
    first = _decision(Gate(min_recovery=0.99))
    tracker.log_verdicts(first)
    summary = tracker.log_decision(first, file)
    assert tracker.find_run(None) == summary
    assert tracker.log_decision(first, file) == summary  # the same policy: the same run
    changed = tracker.log_decision(_decision(Gate(min_recovery=0.95)), file)
    assert changed != summary and tracker.find_run(None) == changed
    assert tracker.download(changed, "gate", tmp_path / "back") is not None


def test_the_shipped_build_is_registered_fetched_and_withdrawn(tracker, tmp_path):
    run = tracker.build_run("int8")
    tracker.log_folder(run, _checkpoint(tmp_path), "quantize/checkpoint")
    source = tracker.artifact_uri(run, "quantize/checkpoint")
    assert tracker.shipped() is None
    registered = tracker.register_ship(run, source, "the only one")
    assert registered["alias"] == "ship" and registered["source"] == source
    shipped = tracker.shipped()
    assert shipped["version"] == registered["version"] and shipped["run_id"] == run and shipped["precision"] == "int8"
    assert tracker.register_ship(run, source, "again")["version"] == registered["version"]  # the same build
    assert tracker.shipped()["description"] == "Chosen by the gate: again"
    # with its ship card: the version's description, and a file on the build's run
    tracker.register_ship(run, source, "again", "# m int8: the build qeval ships\n")
    assert tracker.shipped()["description"] == "# m int8: the build qeval ships\n"
    assert (tracker.download(run, "ship", tmp_path / "card") / "README.md").read_text().startswith("# m int8")
    got = tracker.download_version("ship", tmp_path / "pulled")
    assert got["description"].startswith("# m int8")
    assert ship_card(tracker, got["run_id"]) == "# m int8: the build qeval ships\n"
    assert got["precision"] == "int8" and [p.read_text() for p in (tmp_path / "pulled").rglob("config.json")] == [
        '{"a": 1}'
    ]
    tracker.clear_ship()
    assert tracker.shipped() is None


@pytest.mark.integration
def test_a_registration_that_dies_leaves_ship_where_it_was_and_a_reader_says_how_to_repair(
    workdir, tmp_path, monkeypatch
):
    """A gate that died between moving the alias and writing the version's files record left `ship` on a
    version without it, and `pull` named the wrong fix (issue 41): the alias now moves last."""
    from pipelines.core.system.errors import QevalError
    from pipelines.tracking.mlflow_tracker import MlflowTracker
    from pipelines.tracking.readback import recorded_files

    tracker = MlflowTracker("m")
    first_run = tracker.build_run("int8")
    tracker.log_folder(first_run, _checkpoint(tmp_path), "quantize/checkpoint")
    first = tracker.register_ship(
        first_run, tracker.artifact_uri(first_run, "quantize/checkpoint"), "first", files={"config.json": "a" * 64}
    )
    second_run = tracker.build_run("fp8")
    (tmp_path / "second").mkdir()
    tracker.log_folder(second_run, _checkpoint(tmp_path / "second"), "quantize/checkpoint")

    def dies(*args, **kwargs):
        raise RuntimeError("the gate was killed here")

    monkeypatch.setattr(tracker.client, "set_model_version_tag", dies)
    with pytest.raises(RuntimeError, match="killed"):
        tracker.register_ship(
            second_run,
            tracker.artifact_uri(second_run, "quantize/checkpoint"),
            "second",
            files={"config.json": "b" * 64},
        )
    assert tracker.shipped()["version"] == first["version"] and tracker.shipped()["precision"] == "int8"
    monkeypatch.undo()
    # a version registered without its record (as an interrupted gate of an earlier qeval left one)
    bare = tracker.register_ship(second_run, tracker.artifact_uri(second_run, "quantize/checkpoint"), "bare")
    with pytest.raises(QevalError, match=r"a gate stopped while registering it.*gate again, which records them"):
        recorded_files(tracker, tracker.shipped())
    assert bare["version"] != first["version"]


@pytest.mark.integration
def test_a_report_written_while_a_gate_replaces_the_summary_run_lands_on_the_new_one(workdir, tmp_path, monkeypatch):
    """`qeval report` while a gate with a changed policy replaced the summary run failed with MLflow's "must be
    in the 'active' state" (issue 41): the writer looks the run up again."""
    from pipelines.tracking.mlflow_tracker import MlflowTracker

    tracker, gate = MlflowTracker("m"), MlflowTracker("m")
    old, replaced = tracker.summary_run(), []
    log_artifact = tracker.client.log_artifact

    def meanwhile(run_id, *args, **kwargs):
        if run_id == old and not replaced:  # the gate replaces the run between the report's first and last write
            replaced.append(gate.summary_run(new=True))
        return log_artifact(run_id, *args, **kwargs)

    monkeypatch.setattr(tracker.client, "log_artifact", meanwhile)
    page = tmp_path / "report.md"
    page.write_text("# report\n")
    got = tracker.log_report({}, [page])
    assert replaced and got == replaced[0] == gate.find_run(None) != old
    assert (tracker.download(got, "report", tmp_path / "back") / "report.md").read_text() == "# report\n"
