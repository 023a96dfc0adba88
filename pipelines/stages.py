"""The stage framework: cached, atomic, tracked units of work per build.

A stage's work returns its typed result (pipelines/results.py), which goes into
artifacts/<model>/<precision>/<stage>/manifest.json beside the stage's files. The stage is skipped
when its inputs digest (settings, input files, code of the stage) matches a finished manifest. Work
happens in a `<stage>.partial-<pid>` folder that replaces the old one only once everything, MLflow
included, has succeeded: a crash leaves the previous result intact and nothing half-written marked
done. A failed stage is tagged `failed` in MLflow with its error and kept as `<stage>.failed/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any, Generic, TypeVar

from pipelines import progress
from pipelines.errors import QevalError
from pipelines.paths import REPO_ROOT, STAGE_LOG, file_digest
from pipelines.results import STAGES, CodeVersion, Manifest, StageResult, build_dir, read_manifest, write_manifest
from pipelines.store_uri import store_error
from pipelines.tracking import ParamsChanged, Tracker

log = logging.getLogger(__name__)

_VERSIONED = ["torch", "transformers", "lm_eval", "llmcompressor", "compressed-tensors", "mlflow"]
R = TypeVar("R", bound=StageResult)


@dataclass(frozen=True)
class StageRecord(Generic[R]):
    """A stage of one build, done now or found done earlier."""

    model: str
    precision: str
    stage: str
    status: str  # "done" (ran now) or "skipped" (inputs unchanged)
    seconds: float
    digest: str
    run_id: str
    path: Path
    result: R

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
            "result": json.loads(self.result.model_dump_json()),
        }


def inputs_digest(inputs: Mapping[str, Any], code: Iterable[Path]) -> str:
    """The cache key of a stage: its settings and the source of the code that does the work."""
    h = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode())
    h.update(file_digest(code).encode())
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


@cache
def code_version() -> CodeVersion:
    """The git commit of qeval's code and whether tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout

    try:
        return CodeVersion(
            commit=git("rev-parse", "HEAD").strip(), dirty=bool(git("status", "--porcelain", "-uno").strip())
        )
    except (OSError, subprocess.SubprocessError):
        return CodeVersion(commit="unknown", dirty=None)


@contextmanager
def _build_lock(model: str, precision: str) -> Iterator[None]:
    """One stage at a time per build; different builds and models run in parallel."""
    from filelock import FileLock

    folder = build_dir(model, precision)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(folder / ".lock")
        lock.acquire()
    except OSError as e:
        raise QevalError(f"cannot write artifacts under {folder}: {e.strerror}; set QEVAL_WORKDIR") from None
    try:
        yield
    finally:
        lock.release()


@contextmanager
def _capture_log(path: Path) -> Iterator[None]:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def _files(folder: Path, manifest: Manifest) -> list[Path]:
    unlogged = type(manifest.result).UNLOGGED
    empty = [p for p in folder.iterdir() if p.is_file() and p.stat().st_size == 0]  # e.g. a stage that logged nothing
    return [p for p in sorted(folder.iterdir()) if p.name not in unlogged and p not in empty]


def _log_to_run(tracker: Tracker, manifest: Manifest, folder: Path) -> str:
    """Log a stage to the build's current run; on changed params, start a new run and re-log the rest."""
    precision = manifest.precision
    run_id = tracker.build_run(precision)
    try:
        tracker.log_stage(run_id, manifest, _files(folder, manifest))
        return run_id
    except ParamsChanged:
        log.info("%s@%s: %s settings changed; starting a new MLflow run", tracker.model, precision, manifest.stage)
    run_id = tracker.build_run(precision, new=True)
    for stage, kind in STAGES.items():
        other = build_dir(tracker.model, precision) / stage
        done = read_manifest(other, kind) if stage != manifest.stage else None
        if done is not None:
            tracker.log_stage(run_id, done, _files(other, done))
    tracker.log_stage(run_id, manifest, _files(folder, manifest))
    return run_id


def _record(manifest: Manifest[R], status: str, run_id: str, path: Path) -> StageRecord[R]:
    m = manifest
    return StageRecord(m.model, m.precision, m.stage, status, m.seconds, m.inputs_digest, run_id, path, m.result)


def promote(partial: Path, final: Path) -> None:
    """Put a finished stage folder in place of the previous one, whose leftovers go."""
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    partial.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(final.with_name(f"{final.name}.failed"), ignore_errors=True)


def _fail(tracker: Tracker, partial: Path, final: Path, precision: str, e: Exception) -> QevalError:
    """Keep a failed attempt as `<stage>.failed/`, tag the run, and say so in one line."""
    error = str(e) if isinstance(e, QevalError) else f"{type(e).__name__}: {e}"
    failed = final.with_name(f"{final.name}.failed")
    shutil.rmtree(failed, ignore_errors=True)
    partial.rename(failed)
    try:
        tracker.mark_failed(tracker.build_run(precision), final.name, error)
    except Exception as tagging:  # the store itself may be what failed; the error below says so
        log.warning("could not tag the failure in MLflow: %s", store_error(tracker.uri, tagging))
    return QevalError(f"stage '{final.name}' failed for {tracker.model}@{precision}: {error} (log: {failed})")


def run_stage(
    tracker: Tracker,
    precision: str,
    kind: type[R],
    inputs: Mapping[str, Any],
    code: Iterable[Path],
    work: Callable[[Path], R],
    *,
    force: bool = False,
) -> StageRecord[R]:
    """Run `work(folder)` for one build's stage unless an identical run is already done."""
    model, stage = tracker.model, kind.STAGE
    digest = inputs_digest(inputs, code)
    final = build_dir(model, precision) / stage
    with _build_lock(model, precision):
        for stale in final.parent.glob(f"{stage}.partial-*"):  # left by a killed run; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        done = read_manifest(final, kind)
        if not force and done is not None and done.inputs_digest == digest:
            run_id = tracker.build_run(precision)
            if not tracker.stage_is_logged(run_id, stage, digest):  # e.g. a fresh MLflow store
                run_id = _log_to_run(tracker, done, final)
            log.info("%s@%s %s: unchanged, skipped", model, precision, stage)
            return _record(done, "skipped", run_id, final)

        partial = final.with_name(f"{stage}.partial-{os.getpid()}")
        partial.mkdir(parents=True)
        started = datetime.now(UTC)
        t0 = time.perf_counter()
        expected = progress.estimate(model, stage, done.seconds if done else None)
        about = f" (about {progress.duration(expected)})" if expected else ""
        log.info("%s@%s %s: running%s; log: %s", model, precision, stage, about, final / STAGE_LOG)
        (partial / STAGE_LOG).write_text(
            f"{started.isoformat(timespec='seconds')} {model}@{precision} {stage}: inputs digest {digest}, "
            f"code {code_version().commit}{' (uncommitted changes)' if code_version().dirty else ''}\n"
        )
        try:
            with _capture_log(partial / STAGE_LOG), progress.heartbeat(f"{model}@{precision} {stage}", expected):
                result = work(partial)
        except Exception as e:
            raise _fail(tracker, partial, final, precision, e) from e
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (pipelines/cli.py): failed, never done
            _fail(tracker, partial, final, precision, QevalError("interrupted"))
            raise
        manifest = Manifest[kind](
            model=model,
            precision=precision,
            stage=stage,
            inputs=dict(inputs),
            inputs_digest=digest,
            started=started.isoformat(timespec="seconds"),
            seconds=round(time.perf_counter() - t0, 2),
            versions=library_versions(),
            code=code_version(),
            result=result,
        )
        write_manifest(partial, manifest)
        try:
            run_id = _log_to_run(tracker, manifest, partial)
        except Exception as e:  # the store failed under us (read-only, full, gone): not done, one line
            raise _fail(tracker, partial, final, precision, QevalError(store_error(tracker.uri, e))) from None
        promote(partial, final)
        progress.finished(model, stage, manifest.seconds)
        return _record(manifest, "done", run_id, final)
