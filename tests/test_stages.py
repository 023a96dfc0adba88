"""The stage framework: caching (inputs and code), atomic results, failures, and logging to a real MLflow store."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import REPO
from memory_tracker import MemoryTracker

from pipelines.core.framework import runner
from pipelines.core.framework.code import code_digest, code_version
from pipelines.core.framework.runner import run_stage
from pipelines.core.store.layout import stage_dir
from pipelines.core.store.manifests import finished
from pipelines.core.store.results import Quantized, Served, Sized
from pipelines.core.system.errors import QevalError


def _served() -> Served:
    from eval.load.loadgen import LoadSettings
    from pipelines.core.card.cards import Slo
    from pipelines.core.store.results import GeneratorCeiling

    load = LoadSettings(
        api="completions", concurrency=[1], requests_per_user=1, warmup=0, input_len=1, output_len=2, timeout_s=1
    )
    return Served(
        engine="external",
        execution="unknown",
        load=load,
        slo=Slo(ttft_ms=1, tpot_ms=1),
        per_level={},
        max_users_at_slo=0,
        failed_requests=0,
        generator_ceiling=GeneratorCeiling(chunks_per_s=1, concurrency=1, failed=0),
        generator_bound=False,
    )


def _sized() -> Sized:
    from eval.devices.gpus import get_gpu
    from eval.devices.sizing import Assumptions, Shape, fit

    shape = Shape(layers=2, hidden=128, intermediate=256, heads=2, kv_heads=2, head_dim=64, vocab=512, tied=False)
    f = fit(shape, "bf16", get_gpu("l4"), batch=1, input_len=8, output_len=8, group_size=128)
    return Sized(
        batch=1,
        input_len=8,
        output_len=8,
        group_size=128,
        weights_bytes=1e6,
        weights_from="from config",
        weights_bytes_from_config=1e6,
        kv_bytes_per_token=1024,
        assumptions=Assumptions(),
        fits=[f],
    )


class Work:
    """A stage body that counts its calls, writes one file and returns a result (the quantize stage's type)."""

    def __init__(self, gb: float = 1.0, fail: bool = False, scheme: str = "a"):
        self.calls, self.gb, self.fail, self.scheme = 0, gb, fail, scheme

    def __call__(self, out: Path) -> Quantized:
        self.calls += 1
        (out / "result.txt").write_text(str(self.gb))
        if self.fail:
            raise RuntimeError("boom")
        return Quantized(checkpoint="x", checkpoint_bytes=int(self.gb * 1e9), scheme=self.scheme)


def test_done_stage_is_skipped_until_inputs_change_or_forced(workdir):
    tracker, work = MemoryTracker("m"), Work()
    first = run_stage(tracker, "bf16", Quantized, {"k": 1}, work)
    assert first.status == "done" and work.calls == 1 and first.result.checkpoint_bytes == 10**9
    assert (stage_dir("m", "bf16", "quantize") / "result.txt").read_text() == "1.0"
    assert run_stage(tracker, "bf16", Quantized, {"k": 1}, work).status == "skipped"
    assert work.calls == 1
    assert run_stage(tracker, "bf16", Quantized, {"k": 1}, work, force=True).status == "done"
    assert run_stage(tracker, "bf16", Quantized, {"k": 2}, work).status == "done"
    assert work.calls == 3
    done = finished("m", "bf16", Quantized)
    assert done.result == first.result and done.code == code_version() and done.versions["torch"] != "absent"


def _mlflow():
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.mlflow_tracker import MlflowTracker
    from pipelines.tracking.store import tracking_uri

    return MlflowTracker, MlflowClient(tracking_uri())


@pytest.mark.integration
def test_a_stage_is_logged_to_its_builds_run(workdir):
    MlflowTracker, client = _mlflow()
    record = run_stage(MlflowTracker("m"), "bf16", Quantized, {"k": 1}, Work(2.0))
    run = client.get_run(record.run_id)
    assert run.data.metrics["size/checkpoint_gb"] == 2.0
    assert run.data.params["quant.scheme"] == "a"
    assert run.data.tags["qeval.stage.quantize"] == "done"
    assert run.data.tags["mlflow.source.git.commit"] == code_version().commit
    artifacts = {a.path for a in client.list_artifacts(record.run_id, "quantize")}
    assert {"quantize/manifest.json", "quantize/result.txt", "quantize/stage.log"} <= artifacts


@pytest.mark.integration
def test_failed_stage_is_tagged_and_keeps_the_earlier_result(workdir):
    MlflowTracker, client = _mlflow()
    tracker = MlflowTracker("m")
    good = run_stage(tracker, "bf16", Quantized, {"k": 1}, Work(1.0))
    with pytest.raises(QevalError, match=r"stage 'quantize' failed for m@bf16: RuntimeError: boom \(log: "):
        run_stage(tracker, "bf16", Quantized, {"k": 2}, Work(2.0, fail=True))
    tags = client.get_run(good.run_id).data.tags
    assert tags["qeval.stage.quantize"] == "failed" and tags["qeval.stage.quantize.error"] == "RuntimeError: boom"
    final = stage_dir("m", "bf16", "quantize")
    assert finished("m", "bf16", Quantized).inputs_digest == good.digest  # the earlier result is intact
    assert (final.parent / "quantize.failed" / "result.txt").read_text() == "2.0"
    assert not list(final.parent.glob("quantize.partial-*"))
    # the next run with the good inputs finds its result and marks the stage done again
    again = run_stage(tracker, "bf16", Quantized, {"k": 1}, Work(1.0))
    assert again.status == "skipped"
    tags = client.get_run(again.run_id).data.tags
    assert tags["qeval.stage.quantize"] == "done" and "qeval.stage.quantize.error" not in tags


def test_first_run_crash_leaves_nothing_marked_done(workdir):
    with pytest.raises(QevalError):
        run_stage(MemoryTracker("m"), "bf16", Quantized, {"k": 1}, Work(fail=True))
    assert finished("m", "bf16", Quantized) is None
    assert not (stage_dir("m", "bf16", "quantize") / "manifest.json").exists()


@pytest.mark.integration
def test_changed_params_start_a_new_run_that_carries_the_other_stages(workdir):
    MlflowTracker, client = _mlflow()
    tracker = MlflowTracker("m")
    other = run_stage(tracker, "bf16", Sized, {}, lambda out: _sized())
    run_stage(tracker, "bf16", Quantized, {"k": 1}, Work(1.0, scheme="a"))
    second = run_stage(tracker, "bf16", Quantized, {"k": 2}, Work(2.0, scheme="b"))
    assert second.run_id != other.run_id
    old = client.get_run(other.run_id)
    assert old.data.tags["qeval.superseded_by"] == second.run_id
    assert old.info.lifecycle_stage == "deleted"  # out of the runs table, restorable
    data = client.get_run(second.run_id).data
    assert data.params["quant.scheme"] == "b"
    assert data.metrics["size/checkpoint_gb"] == 2.0 and data.metrics["size/kv_bytes_per_token"] == 1024
    assert data.tags["qeval.stage.size"] == "done"


@pytest.mark.integration
def test_a_fresh_store_is_refilled_from_the_manifests(workdir, monkeypatch):
    MlflowTracker, _ = _mlflow()
    run_stage(MlflowTracker("m"), "bf16", Quantized, {"k": 1}, Work(3.0))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'other.db'}")
    MlflowTracker, client = _mlflow()
    work = Work(3.0)
    record = run_stage(MlflowTracker("m"), "bf16", Quantized, {"k": 1}, work)
    assert record.status == "skipped" and work.calls == 0
    assert client.get_run(record.run_id).data.metrics["size/checkpoint_gb"] == 3.0


def test_a_manifest_of_other_code_is_not_a_finished_stage(workdir):
    run_stage(MemoryTracker("m"), "bf16", Quantized, {"k": 1}, Work(1.0))
    path = stage_dir("m", "bf16", "quantize") / "manifest.json"
    path.write_text(path.read_text().replace('"checkpoint_bytes"', '"bytes"'))
    assert finished("m", "bf16", Quantized) is None
    assert run_stage(MemoryTracker("m"), "bf16", Quantized, {"k": 1}, Work(1.0)).status == "done"


def test_a_killed_runs_partial_folder_goes_even_when_the_stage_is_skipped(workdir):
    tracker, work = MemoryTracker("m"), Work()
    run_stage(tracker, "bf16", Quantized, {"k": 1}, work)
    killed = stage_dir("m", "bf16", "quantize").with_name("quantize.partial-99999")  # a `--force` run, killed
    killed.mkdir()
    (killed / "weights.bin").write_bytes(b"x" * 1000)
    assert run_stage(tracker, "bf16", Quantized, {"k": 1}, work).status == "skipped"
    assert not killed.exists()


def test_a_stage_reruns_when_code_it_only_reaches_through_an_import_changes(workdir, tmp_path, monkeypatch):
    """The cache key holds the stage module's code and every first-party module it imports, transitively:
    TPOT is defined in eval/devices/speed.py, which the serve stage reaches only through eval/load/serving.py."""
    tree = tmp_path / "tree"
    for package in ("pipelines", "eval", "quant", "refmodel"):
        shutil.copytree(REPO / package, tree / package, ignore=shutil.ignore_patterns("__pycache__", "*.jsonl"))
    monkeypatch.setattr(runner, "code_digest", lambda module: code_digest(module, tree))
    tracker = MemoryTracker("m")

    def stage(kind, work) -> str:
        return run_stage(tracker, "bf16", kind, {"k": 1}, work).status

    served, quantized = Work(), Work()
    served_work = lambda out: served(out) and _served()  # noqa: E731 - a Served result from the counting body
    assert (stage(Served, served_work), stage(Quantized, quantized)) == ("done", "done")
    assert (stage(Served, served_work), stage(Quantized, quantized)) == ("skipped", "skipped")
    engines = tree / "pipelines" / "stages" / "engines.py"  # imported by the serve stage alone
    engines.write_text(engines.read_text() + "\n# a change the quantize stage does not run\n")
    assert (stage(Served, served_work), stage(Quantized, quantized)) == ("done", "skipped")
    speed = tree / "eval" / "devices" / "speed.py"
    speed.write_text(
        speed.read_text().replace(
            "return (e2e_s - ttft_s) / (output_tokens - 1)", "return (e2e_s - ttft_s) / output_tokens"
        )
    )
    assert stage(Served, served_work) == "done" and served.calls == 3  # measured again under the new definition
