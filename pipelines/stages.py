"""The stage framework: cached, atomic, tracked units of work per build.

A stage's outputs go to artifacts/<model>/<precision>/<stage>/ with manifest.json. The stage is
skipped when its inputs digest (settings, input files, code of the stage) matches a done manifest.
Work happens in a `<stage>.partial-<pid>` folder that replaces the old one only once everything,
MLflow included, has succeeded: a crash leaves the previous result intact and nothing half-written
marked done. A failed stage is tagged `failed` in MLflow with its error and kept as `<stage>.failed/`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from pipelines.errors import QevalError
from pipelines.paths import artifacts_dir
from pipelines.tracking import ParamsChanged, Tracker

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_VERSIONED = ["torch", "transformers", "lm_eval", "llmcompressor", "compressed-tensors", "mlflow"]


@dataclass(frozen=True)
class StageOutput:
    """What a stage's work returns: MLflow metrics and params, and a JSON summary for people."""

    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Metrics over a step (batch size, concurrency): name -> [(step, value), ...]."""
    params: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    unlogged: list[str] = field(default_factory=list)
    """Top-level names in the stage folder kept out of MLflow (e.g. a multi-GB checkpoint)."""
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Data sets the stage read, by name: source and sha256, logged as MLflow run inputs."""


@dataclass(frozen=True)
class StageRecord:
    """A stage of one build, done now or found done earlier."""

    model: str
    precision: str
    stage: str
    status: str  # "done" (ran now) or "skipped" (inputs unchanged)
    seconds: float
    digest: str
    run_id: str
    path: Path
    metrics: dict[str, float]
    summary: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "precision": self.precision,
            "stage": self.stage,
            "status": self.status,
            "seconds": self.seconds,
            "digest": self.digest,
            "run_id": self.run_id,
            "path": str(self.path),
            "metrics": self.metrics,
            "summary": self.summary,
        }


def file_digest(paths: Iterable[Path]) -> str:
    """sha256 over files (and every file under folders), by relative name and content."""
    h = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def inputs_digest(inputs: Mapping[str, Any], code: Iterable[Path]) -> str:
    """The cache key of a stage: its settings and the source of the code that does the work."""
    h = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode())
    h.update(file_digest(code).encode())
    return h.hexdigest()


def stage_dir(model: str, precision: str, stage: str) -> Path:
    return artifacts_dir() / model / precision / stage


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def library_versions() -> dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


@contextmanager
def _build_lock(model: str, precision: str):
    """One stage at a time per build; different builds and models run in parallel."""
    folder = artifacts_dir() / model / precision
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fh = open(folder / ".lock", "a")  # noqa: SIM115 - released in finally
    except OSError as e:
        raise QevalError(f"cannot write artifacts under {folder}: {e.strerror}; set QEVAL_WORKDIR") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


@contextmanager
def _capture_log(path: Path):
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def _log_to_run(tracker: Tracker, precision: str, stage: str, manifest: dict, files: Path) -> str:
    """Log a stage to the build's current run; on changed params, start a new run and re-log the rest."""
    run_id = tracker.build_run(precision)
    try:
        _log_manifest(tracker, run_id, manifest, files)
        return run_id
    except ParamsChanged:
        log.info("%s@%s: %s settings changed; starting a new MLflow run", tracker.model, precision, stage)
    run_id = tracker.build_run(precision, new=True)
    for other in sorted((artifacts_dir() / tracker.model / precision).iterdir()):
        done = read_manifest(other)
        if done and done.get("status") == "done" and done["stage"] == other.name != stage:
            _log_manifest(tracker, run_id, done, other)
    _log_manifest(tracker, run_id, manifest, files)
    return run_id


def _log_manifest(tracker: Tracker, run_id: str, manifest: dict, folder: Path) -> None:
    files = [p for p in sorted(folder.iterdir()) if p.name not in manifest.get("unlogged", [])]
    tracker.log_stage(
        run_id,
        manifest["stage"],
        manifest["inputs_digest"],
        manifest["metrics"],
        manifest["params"],
        files,
        manifest.get("series", {}),
        manifest.get("datasets", {}),
    )


def run_stage(
    tracker: Tracker,
    precision: str,
    stage: str,
    inputs: Mapping[str, Any],
    code: Iterable[Path],
    work: Callable[[Path], StageOutput],
    *,
    force: bool = False,
) -> StageRecord:
    """Run `work(folder)` for one build's stage unless an identical run is already done."""
    model = tracker.model
    digest = inputs_digest(inputs, code)
    final = stage_dir(model, precision, stage)
    with _build_lock(model, precision):
        done = read_manifest(final)
        if not force and done and done.get("status") == "done" and done.get("inputs_digest") == digest:
            run_id = tracker.build_run(precision)
            if not tracker.stage_is_logged(run_id, stage, digest):  # e.g. a fresh MLflow store
                run_id = _log_to_run(tracker, precision, stage, done, final)
            log.info("%s@%s %s: unchanged, skipped", model, precision, stage)
            return _record(done, "skipped", run_id, final)

        for stale in final.parent.glob(f"{stage}.partial-*"):  # left by an interrupted run; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        partial = final.with_name(f"{stage}.partial-{os.getpid()}")
        partial.mkdir(parents=True)
        started = datetime.now(UTC)
        t0 = time.perf_counter()
        log.info("%s@%s %s: running", model, precision, stage)
        try:
            with _capture_log(partial / "stage.log"):
                out = work(partial)
        except Exception as e:
            error = f"{type(e).__name__}: {e}" if not isinstance(e, QevalError) else str(e)
            failed = final.with_name(f"{stage}.failed")
            shutil.rmtree(failed, ignore_errors=True)
            partial.rename(failed)
            tracker.mark_failed(tracker.build_run(precision), stage, error)
            raise QevalError(f"stage '{stage}' failed for {model}@{precision}: {error} (log: {failed})") from e
        manifest = {
            "model": model,
            "precision": precision,
            "stage": stage,
            "status": "done",
            "inputs": dict(inputs),
            "inputs_digest": digest,
            "started": started.isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - t0, 2),
            "metrics": out.metrics,
            "series": out.series,
            "params": out.params,
            "summary": out.summary,
            "unlogged": out.unlogged,
            "datasets": out.datasets,
            "versions": library_versions(),
        }
        write_json_atomic(partial / MANIFEST, manifest)
        run_id = _log_to_run(tracker, precision, stage, manifest, partial)
        old = final.with_name(f"{stage}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(final.with_name(f"{stage}.failed"), ignore_errors=True)
        return _record(manifest, "done", run_id, final)


def _record(manifest: dict, status: str, run_id: str, path: Path) -> StageRecord:
    return StageRecord(
        model=manifest["model"],
        precision=manifest["precision"],
        stage=manifest["stage"],
        status=status,
        seconds=manifest["seconds"],
        digest=manifest["inputs_digest"],
        run_id=run_id,
        path=path,
        metrics=manifest["metrics"],
        summary=manifest["summary"],
    )
