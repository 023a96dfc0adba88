"""The tracking store as the system of record; artifacts/ as this machine's cache of it.

Every finished stage logs its folder (manifest.json, per-document records, logs; a quantized build's
checkpoint too) to its build's run (pipelines/core/framework/runner.py). A machine that did not run a stage, or whose
copy is older than the run's, reads it back from there before the gate, the report or a later stage of
another build uses it: `qeval gate` on an empty folder reaches the decision the machine that ran the stages
reached. A checkpoint is never fetched here (`qeval pull` is for that).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TypeVar

from eval.quality.paired import Scored
from pipelines.core.card.cards import ModelCard
from pipelines.core.framework.registry import JUDGED, STAGES
from pipelines.core.framework.tracker import Tracker
from pipelines.core.store.layout import CHECKPOINT_DIR, build_dir, gate_file, ship_dir, stage_dir
from pipelines.core.store.manifests import not_as_left, read_manifest
from pipelines.core.store.results import Evaluated, StageResult
from pipelines.core.store.verdicts import Decision
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import atomic_write, locked, replace_dir, scratch
from pipelines.core.system.integrity import Tampered, check_folder, hashes_digest
from pipelines.core.system.paths import artifacts_dir, cards_dir, mlruns_dir, workdir
from pipelines.tracking.names import SHIP_CARD, SHIP_FILES, registered_model_name

R = TypeVar("R", bound=StageResult)
README = "README.md"  # the ship card, in a pulled folder

log = logging.getLogger(__name__)


def fetch_stage(tracker: Tracker, run_id: str, precision: str, stage: str, into: Path | None = None) -> bool:
    """Bring the run's `stage` into the cache (or `into`), unless the copy there is the run's; True when
    the cache holds the run's stage afterwards, False when the run has none."""
    digest = tracker.logged_digest(run_id, stage)
    if digest is None:
        return False
    final = into or stage_dir(tracker.model, precision, stage)
    # the build's lock, as a stage holds it (core/framework/runner.py)
    with locked(final.parent / ".lock", "artifacts"):
        return _fetch_locked(tracker, run_id, precision, stage, final, digest)


def _fetch_locked(tracker: Tracker, run_id: str, precision: str, stage: str, final: Path, digest: str) -> bool:
    spec = STAGES[stage]
    here = read_manifest(final, spec.result)
    if here is not None and here.inputs_digest == digest:
        return True
    with scratch(final, "fetch") as folder:
        skipped = (CHECKPOINT_DIR,)  # a checkpoint is pull's to fetch
        got = tracker.download(run_id, stage, folder, skip=skipped)
        fetched = read_manifest(got, spec.result) if got else None
        if got is None or fetched is None or fetched.inputs_digest != digest:
            raise QevalError(
                f"{tracker.model}@{precision} {stage}: the MLflow run {run_id} is tagged done but its "
                f"{stage}/manifest.json is {'missing' if fetched is None else 'of another run of the stage'}; "
                f"rerun: qeval {spec.command} --model {tracker.model} --precision {precision} --force"
            )
        lost = [f"{f} is missing" for f in fetched.files if f not in skipped and not (got / f).exists()]
        if lost or (lost := [c for c in [not_as_left(got, fetched)] if c]):
            raise QevalError(
                f"{tracker.model}@{precision} {stage}: the MLflow run {run_id} is tagged done but of its manifest's "
                f"files {', '.join(lost[:3])} (an upload cut short, or a store changed?); rerun: "
                f"qeval {spec.command} --model {tracker.model} --precision {precision} --force"
            )
        replace_dir(got, final)  # as a finished stage replaces the previous one
    log.info("%s@%s %s: read from the tracking store (run %s)", tracker.model, precision, stage, run_id)
    return True


def logged_result(tracker: Tracker, run_id: str, kind: type[R]) -> R | None:
    """The result of the run's finished stage of this kind, read from the store without keeping its files
    (nor a checkpoint) here; None where the run holds none."""
    digest = tracker.logged_digest(run_id, kind.STAGE)
    if digest is None:
        return None
    with tempfile.TemporaryDirectory(prefix="qeval-stage-") as tmp:
        got = tracker.download(run_id, kind.STAGE, Path(tmp), skip=(CHECKPOINT_DIR,))
        done = read_manifest(got, kind) if got else None
    return done.result if done is not None and done.inputs_digest == digest else None


def fetch_builds(
    card: ModelCard, tracker: Tracker, precisions: list[str] | None = None, stages: tuple[str, ...] = JUDGED
) -> None:
    """Each build's `stages` from its current run into the cache, where the cache lacks them."""
    for precision in precisions or card.precisions:
        run_id = tracker.find_run(precision)
        if run_id is None:
            continue
        build_dir(card.name, precision).mkdir(parents=True, exist_ok=True)
        for stage in stages:
            fetch_stage(tracker, run_id, precision, stage)


def fetch_decision(tracker: Tracker) -> bool:
    """The gate's last decision (the summary run's gate.json) into the cache; False when none is logged."""
    run_id = tracker.find_run(None)
    if run_id is None:
        return False
    final = gate_file(tracker.model)
    with scratch(final, "fetch") as folder:
        got = tracker.download(run_id, "gate", folder)
        if got is None or not (got / final.name).is_file():
            return False
        try:
            Decision.model_validate_json((got / final.name).read_text())  # this qeval's, or not taken
        except ValueError:
            return False
        os.replace(got / final.name, final)
    return True


def fetch_shipped(card: ModelCard, tracker: Tracker) -> tuple[dict[str, str], tuple[Scored, Evaluated]] | None:
    """The registry version behind alias `ship` and its build's evaluation (per-document records), read from
    its run into artifacts/<model>/ship-v<version>/; None when nothing ships."""
    info = tracker.shipped()
    if info is None:
        return None
    folder = ship_dir(card.name, info["version"]) / Evaluated.STAGE
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not info["run_id"] or not fetch_stage(tracker, info["run_id"], info["precision"], Evaluated.STAGE, folder):
        raise QevalError(
            f"gate --against ship: version {info['version']} of {card.name} (run {info['run_id'] or 'none'}) has "
            f"no logged evaluation to compare with"
        )
    done = read_manifest(folder, Evaluated)
    assert done is not None  # fetch_stage checked it
    return info, (Scored(folder, done.result.accuracy), done.result)


def ship_card(tracker: Tracker, run_id: str) -> str | None:
    """The whole ship card the gate logged on the shipped build's run (pipelines/present/shipcard.py), or None."""
    if not run_id:
        return None
    with tempfile.TemporaryDirectory(prefix="qeval-card-") as tmp:
        got = tracker.download(run_id, SHIP_CARD.split("/")[0], Path(tmp))
        card = got / SHIP_CARD.split("/")[1] if got else None
        return card.read_text() if card and card.is_file() else None


def recorded_files(tracker: Tracker, info: dict[str, str]) -> dict[str, str]:
    """The checkpoint's files as the gate judged them (name -> sha256), for a registry version (`info` from
    shipped() or download_version()): the run's `ship/files.json`, checked against the digest the gate kept
    on the version, so that neither the files nor their record can be changed alone."""
    what = f"{registered_model_name(tracker.model)} version {info['version']}"
    files = None
    with tempfile.TemporaryDirectory(prefix="qeval-files-") as tmp:
        got = tracker.download(info["run_id"], SHIP_FILES.split("/")[0], Path(tmp)) if info["run_id"] else None
        record = got / SHIP_FILES.split("/")[1] if got else None
        if record is not None and record.is_file():
            files = json.loads(record.read_text())
    if not files or not info.get("files"):
        raise QevalError(
            f"{what} carries no record of its checkpoint's files (a gate stopped while registering "
            f"it, or an earlier qeval gated it): nothing to verify against; gate again, which records "
            f"them: qeval gate -m {tracker.model} (a build quantized by an earlier qeval has none to "
            f"record: first qeval quantize -m {tracker.model} --precision {info['precision']} --force)"
        )
    if hashes_digest(files) != info["files"]:
        raise Tampered(
            f"{what}: the file digests on run {info['run_id']} ({SHIP_FILES}) are not those the gate "
            f"registered; the store was changed after the gate: rebuild and gate again"
        )
    return files


def verify(tracker: Tracker, info: dict[str, str], folder: Path) -> int:
    """Tampered naming the first file of `folder` that is not the registered checkpoint's; the files checked."""
    files = recorded_files(tracker, info)
    check_folder(
        folder,
        files,
        f"{registered_model_name(tracker.model)} version {info['version']}",
        "these are not the bytes the gate judged: delete the folder and pull again, or rebuild and gate again",
        extra_ok=(README,),
    )
    return len(files)


def pull(tracker: Tracker, alias: str, folder: Path) -> dict:
    """The registry version behind `alias` (its build's checkpoint) into `folder`, whole or not at all, with
    its ship card as README.md where the gate wrote one; every file checked against what the gate judged
    before the folder is put in place."""
    folder = folder.resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise QevalError(f"{folder} exists and is not an empty folder; name a new one")
    for kept in (artifacts_dir(), mlruns_dir(), workdir() / "reports", cards_dir()):
        if folder.is_relative_to(kept.resolve()):
            raise QevalError(
                f"{folder} is inside {kept}, which qeval keeps (a change there is a tampered build "
                f"or a lost result); name a folder outside it"
            )
    try:
        with scratch(folder, "pull") as landing:
            got = tracker.download_version(alias, landing)
            # MLflow puts a folder source under its own name (checkpoint/); the servable folder holds config.json
            config = next(iter(sorted(landing.rglob("config.json"), key=lambda p: len(p.parts))), None)
            if config is None:
                raise QevalError(f"{got['name']} version {got['version']} has no config.json: not a servable folder")
            verified = verify(tracker, got, config.parent)
            if folder.exists():
                folder.rmdir()
            folder.parent.mkdir(parents=True, exist_ok=True)
            if card := ship_card(tracker, got.get("run_id", "")):
                atomic_write(config.parent / README, card)
            config.parent.rename(folder)
    except OSError as e:  # a read-only or full place: one line, nothing left half-written
        raise QevalError(f"cannot write the build into {folder}: {e.strerror}; name a writable folder") from None
    files = [f for f in folder.rglob("*") if f.is_file()]
    return {
        **got,
        "folder": str(folder),
        "files": len(files),
        "verified": verified,
        "bytes": sum(f.stat().st_size for f in files),
    }
