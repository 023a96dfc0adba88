from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.errors import QevalError
from pipelines.stages import StageOutput, read_manifest, run_stage, stage_dir
from pipelines.tracking import Tracker, tracking_uri

CODE = [Path(__file__)]


class Work:
    """A stage body that counts its calls and writes one file."""

    def __init__(self, value: float = 1.0, fail: bool = False, stage: str = "x"):
        self.calls, self.value, self.fail, self.stage = 0, value, fail, stage

    def __call__(self, out: Path) -> StageOutput:
        self.calls += 1
        (out / "result.txt").write_text(str(self.value))
        if self.fail:
            raise RuntimeError("boom")
        return StageOutput(
            metrics={f"{self.stage}/value": self.value}, params={f"{self.stage}.setting": "a"}, summary={}
        )


def test_done_stage_is_skipped_until_inputs_change_or_forced(workdir):
    tracker, work = Tracker("m"), Work()
    first = run_stage(tracker, "bf16", "x", {"k": 1}, CODE, work)
    assert first.status == "done" and work.calls == 1
    assert (stage_dir("m", "bf16", "x") / "result.txt").read_text() == "1.0"
    assert run_stage(tracker, "bf16", "x", {"k": 1}, CODE, work).status == "skipped"
    assert work.calls == 1
    assert run_stage(tracker, "bf16", "x", {"k": 1}, CODE, work, force=True).status == "done"
    assert run_stage(tracker, "bf16", "x", {"k": 2}, CODE, work).status == "done"
    assert work.calls == 3
    run = MlflowClient(tracking_uri()).get_run(first.run_id)
    assert run.data.metrics["x/value"] == 1.0
    assert run.data.params["x.setting"] == "a"
    assert run.data.tags["qeval.stage.x"] == "done"
    artifacts = {a.path for a in MlflowClient(tracking_uri()).list_artifacts(first.run_id, "x")}
    assert {"x/manifest.json", "x/result.txt", "x/stage.log"} <= artifacts


def test_failed_stage_is_tagged_and_keeps_the_earlier_result(workdir):
    tracker = Tracker("m")
    good = run_stage(tracker, "bf16", "x", {"k": 1}, CODE, Work(1.0))
    with pytest.raises(QevalError, match=r"stage 'x' failed for m@bf16: RuntimeError: boom \(log: "):
        run_stage(tracker, "bf16", "x", {"k": 2}, CODE, Work(2.0, fail=True))
    tags = MlflowClient(tracking_uri()).get_run(good.run_id).data.tags
    assert tags["qeval.stage.x"] == "failed" and tags["qeval.stage.x.error"] == "RuntimeError: boom"
    final = stage_dir("m", "bf16", "x")
    assert read_manifest(final)["inputs_digest"] == good.digest  # the earlier result is intact
    assert (final.parent / "x.failed" / "result.txt").read_text() == "2.0"
    assert not list(final.parent.glob("x.partial-*"))
    # the next run with the good inputs finds its result and marks the stage done again
    again = run_stage(tracker, "bf16", "x", {"k": 1}, CODE, Work(1.0))
    assert again.status == "skipped"
    tags = MlflowClient(tracking_uri()).get_run(again.run_id).data.tags
    assert tags["qeval.stage.x"] == "done" and "qeval.stage.x.error" not in tags


def test_first_run_crash_leaves_nothing_marked_done(workdir):
    tracker = Tracker("m")
    with pytest.raises(QevalError):
        run_stage(tracker, "bf16", "x", {"k": 1}, CODE, Work(fail=True))
    assert read_manifest(stage_dir("m", "bf16", "x")) is None


def test_changed_params_start_a_new_run_that_carries_the_other_stages(workdir):
    tracker = Tracker("m")
    other = run_stage(tracker, "bf16", "y", {}, CODE, Work(5.0, stage="y"))

    class Changed(Work):
        def __call__(self, out: Path) -> StageOutput:
            base = super().__call__(out)
            return StageOutput(metrics=base.metrics, params={"x.setting": "b"})

    run_stage(tracker, "bf16", "x", {"k": 1}, CODE, Work(1.0))
    second = run_stage(tracker, "bf16", "x", {"k": 2}, CODE, Changed(2.0))
    assert second.run_id != other.run_id
    client = MlflowClient(tracking_uri())
    old = client.get_run(other.run_id)
    assert old.data.tags["qeval.superseded_by"] == second.run_id
    assert old.info.lifecycle_stage == "deleted"  # out of the runs table, restorable
    data = client.get_run(second.run_id).data
    assert data.params["x.setting"] == "b"
    assert data.metrics["x/value"] == 2.0 and data.metrics["y/value"] == 5.0
    assert data.tags["qeval.stage.y"] == "done"


def test_a_fresh_store_is_refilled_from_the_manifests(workdir, monkeypatch):
    run_stage(Tracker("m"), "bf16", "x", {"k": 1}, CODE, Work(3.0))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'other.db'}")
    work = Work(3.0)
    record = run_stage(Tracker("m"), "bf16", "x", {"k": 1}, CODE, work)
    assert record.status == "skipped" and work.calls == 0
    assert MlflowClient(tracking_uri()).get_run(record.run_id).data.metrics["x/value"] == 3.0
