"""The stage framework: cached, atomic, tracked units of work per build.

A stage's work returns its typed result (pipelines/core/store/results/), which goes into
artifacts/<model>/<precision>/<stage>/manifest.json beside the stage's files. The stage is skipped when its
inputs digest matches a finished manifest: its inputs (settings, and digests of the files it reads) and its
code (pipelines/core/framework/code.py: the stage module and every first-party module it imports). Work happens in a
`<stage>.partial-<pid>` folder that replaces the old one only once everything, MLflow included, has
succeeded: a crash leaves the previous result intact and nothing half-written marked done. A failed stage
is tagged `failed` in the tracker with its error and kept as `<stage>.failed/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pipelines.core.framework.code import code_digest, code_version, environment, library_versions
from pipelines.core.framework.registry import STAGES, spec_of
from pipelines.core.framework.tracker import ParamsChanged, Tracker
from pipelines.core.store.layout import STAGE_LOG, build_dir
from pipelines.core.store.manifests import (
    Manifest,
    StageRecord,
    digests,
    not_as_left,
    read_manifest,
    write_manifest,
)
from pipelines.core.store.results import StageResult
from pipelines.core.system import progress
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import locked, replace_dir
from pipelines.core.system.integrity import Tampered

log = logging.getLogger(__name__)

R = TypeVar("R", bound=StageResult)


def inputs_digest(inputs: Mapping[str, Any], code: str) -> str:
    """The cache key of a stage: its inputs and the digest of its code."""
    h = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode())
    h.update(code.encode())
    return h.hexdigest()


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


def _files(folder: Path) -> list[Path]:
    """What a stage folder holds that is worth logging: everything but empty files (a stage that logged nothing)."""
    return [p for p in sorted(folder.iterdir()) if not (p.is_file() and p.stat().st_size == 0)]


def _logged(tracker: Tracker, stage: str, folder: Path) -> list[Path]:
    """What of a stage's folder goes to the tracker: its files, less those the stage keeps locally where the
    store is on this machine's disk (StageResult.KEPT_LOCALLY)."""
    kept = STAGES[stage].result.KEPT_LOCALLY if tracker.local_artifacts else ()
    return [p for p in _files(folder) if p.name not in kept]


def _log_to_run(tracker: Tracker, manifest: Manifest, folder: Path) -> str:
    """Log a stage to the build's current run; on changed params, start a new run and re-log the rest."""
    precision = manifest.precision
    run_id = tracker.build_run(precision)
    try:
        tracker.log_stage(run_id, manifest, _logged(tracker, manifest.stage, folder))
        return run_id
    except ParamsChanged:
        log.info("%s@%s: %s settings changed; starting a new MLflow run", tracker.model, precision, manifest.stage)
    run_id = tracker.build_run(precision, new=True)
    for stage, spec in STAGES.items():
        other = build_dir(tracker.model, precision) / stage
        done = read_manifest(other, spec.result) if stage != manifest.stage else None
        if done is not None:
            tracker.log_stage(run_id, done, _logged(tracker, stage, other))
    tracker.log_stage(run_id, manifest, _logged(tracker, manifest.stage, folder))
    return run_id


def _record(manifest: Manifest[R], status: str, run_id: str, path: Path) -> StageRecord[R]:
    m = manifest
    return StageRecord(m.model, m.precision, m.stage, status, m.seconds, m.inputs_digest, run_id, path, m.result)


def _fail(tracker: Tracker, partial: Path, final: Path, precision: str, e: Exception) -> QevalError:
    """Keep a failed attempt as `<stage>.failed/`, tag the run, and say so in one line."""
    error = str(e) if isinstance(e, QevalError) else f"{type(e).__name__}: {e}"
    failed = final.with_name(f"{final.name}.failed")
    shutil.rmtree(failed, ignore_errors=True)
    partial.rename(failed)
    try:
        tracker.mark_failed(tracker.build_run(precision), final.name, error)
    except Exception as tagging:  # the store itself may be what failed; the error below says so
        log.warning("could not tag the failure in MLflow: %s", tracker.describe_failure(tagging))
    return QevalError(f"stage '{final.name}' failed for {tracker.model}@{precision}: {error} (log: {failed})")


def run_stage(
    tracker: Tracker,
    precision: str,
    kind: type[R],
    inputs: Mapping[str, Any],
    work: Callable[[Path], R],
    *,
    force: bool = False,
) -> StageRecord[R]:
    """Run `work(folder)` for one build's stage unless an identical run is already done."""
    model, stage = tracker.model, kind.STAGE
    inputs = {**inputs, "environment": environment()}
    digest = inputs_digest(inputs, code_digest(spec_of(kind).module))
    final = build_dir(model, precision) / stage
    with locked(final.parent / ".lock", "artifacts"):  # one stage at a time per build
        for stale in final.parent.glob(f"{stage}.partial-*"):  # left by a killed run; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        done = read_manifest(final, kind)
        same = not force and done is not None and done.inputs_digest == digest
        if same and (lost := not_as_left(final, done)):
            log.warning("%s@%s %s: %s since the stage finished: running it again", model, precision, stage, lost)
            same = False
        if same:
            if altered := done.result.altered(final):
                raise Tampered(
                    f"{model}@{precision} {stage}: {altered}, since the stage finished; not used: rebuild it with "
                    f"qeval {spec_of(kind).command} --model {model} --precision {precision} --force"
                )
            run_id = tracker.build_run(precision)
            if tracker.logged_digest(run_id, stage) != digest:  # e.g. a fresh MLflow store
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
            files=[p.name for p in _files(partial)],
            digests=digests(partial, kind),
        )
        write_manifest(partial, manifest)
        try:
            run_id = _log_to_run(tracker, manifest, partial)
        except Exception as e:  # the store failed under us (read-only, full, gone): not done, one line
            raise _fail(tracker, partial, final, precision, QevalError(tracker.describe_failure(e))) from None
        replace_dir(partial, final)
        progress.finished(model, stage, manifest.seconds)
        return _record(manifest, "done", run_id, final)
