"""The manifest that holds a stage's typed result (pipelines/core/store/results/) beside the stage's files, and
how a stage is read back: finished() and result_of() here, or require() (pipelines/core/framework/registry.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import Field, ValidationError

from pipelines.core.store.layout import MANIFEST, STAGE_LOG, stage_dir
from pipelines.core.store.results import Record, StageResult
from pipelines.core.system.files import atomic_write
from pipelines.core.system.integrity import sha256

R = TypeVar("R", bound=StageResult)


class CodeVersion(Record):
    commit: str = Field(description="git commit of qeval's code, or 'unknown' outside a git checkout")
    dirty: bool | None = Field(description="uncommitted changes to tracked files (None: unknown)")


class Manifest(Record, Generic[R]):
    """How a stage ran, and its result: manifest.json in the stage's folder."""

    model: str
    precision: str
    stage: str
    status: Literal["done"] = "done"
    inputs: dict[str, Any] = Field(description="what the cache key is made of")
    inputs_digest: str
    started: str
    seconds: float
    versions: dict[str, str]
    code: CodeVersion
    result: R
    files: list[str] = Field(
        default_factory=list, description="the folder's other entries, as logged: a reader checks it has them all"
    )
    digests: dict[str, str] = Field(
        default_factory=dict,
        description="sha256 of each file the stage left, by path in its folder, but its log and what its result "
        "checks itself (StageResult.CHECKS_ITSELF): a stage whose files are not these is not done",
    )


def digests(folder: Path, kind: type[StageResult]) -> dict[str, str]:
    """sha256 of each file in a stage's `folder` (by its path there), but its manifest, its log, what its result
    checks itself and empty files (not logged to the store, so not read back from it)."""
    skipped = {MANIFEST, STAGE_LOG, *kind.CHECKS_ITSELF}
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink() and p.stat().st_size)
    return {str(p.relative_to(folder)): sha256(p) for p in files if p.relative_to(folder).parts[0] not in skipped}


def not_as_left(folder: Path, manifest: Manifest) -> str | None:
    """The first file of a finished stage that is missing or changed since the stage left it, as a phrase; None
    where every one is as it was."""
    for name, digest in manifest.digests.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256(path) != digest:
            return f"{name} has changed"
    return None


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
        plain = {f: getattr(self, f) for f in ("model", "precision", "stage", "status", "seconds", "digest", "run_id")}
        return {**plain, "path": str(self.path), "result": json.loads(self.result.model_dump_json())}


def read_manifest(folder: Path, kind: type[R]) -> Manifest[R] | None:
    """The finished stage in `folder`, or None (nothing there, or left by other code)."""
    try:
        return Manifest[kind].model_validate_json((folder / MANIFEST).read_text())
    except (OSError, ValueError, ValidationError):
        return None


def write_manifest(folder: Path, manifest: Manifest) -> None:
    atomic_write(folder / MANIFEST, manifest.model_dump_json(indent=2) + "\n")


def finished(model: str, precision: str, kind: type[R]) -> Manifest[R] | None:
    """The build's finished stage of this kind, or None (also where the folder holds another build's: copied)."""
    done = read_manifest(stage_dir(model, precision, kind.STAGE), kind)
    return done if done is not None and (done.model, done.precision) == (model, precision) else None


def result_of(model: str, precision: str, kind: type[R]) -> R | None:
    """The result of the build's finished stage of this kind, or None where it has not run."""
    done = finished(model, precision, kind)
    return done.result if done else None
