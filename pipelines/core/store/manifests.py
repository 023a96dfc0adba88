"""The manifest that holds a stage's typed result (pipelines/core/store/results.py) beside the stage's files, and
how a stage is read back: finished() and result_of() here, or require() (pipelines/core/framework/registry.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import Field, ValidationError

from pipelines.core.store.layout import MANIFEST, stage_dir
from pipelines.core.store.results import Record, StageResult
from pipelines.core.system.files import atomic_write

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
    """The build's finished stage of this kind, or None."""
    return read_manifest(stage_dir(model, precision, kind.STAGE), kind)


def result_of(model: str, precision: str, kind: type[R]) -> R | None:
    """The result of the build's finished stage of this kind, or None where it has not run."""
    done = finished(model, precision, kind)
    return done.result if done else None
