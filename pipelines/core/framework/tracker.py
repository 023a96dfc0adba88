"""The tracker: what the stages, the gate and the report log through, and read back from.

A protocol, so that the stage framework here needs no MLflow: pipelines/tracking/mlflow_tracker.py is the
implementation that writes a real store, tests/memory_tracker.py one that keeps the same in memory; one set
of contract tests (tests/test_tracker_contract.py) holds both to it. One run per build (`<model>@<precision>`),
one summary run per model for the gate and the report, a Model Registry entry whose alias `ship` points at
the build that ships.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pipelines.core.store.manifests import Manifest
from pipelines.core.store.verdicts import Decision


class ParamsChanged(Exception):
    """A stage reran with other settings: params are immutable, so the build needs a new run."""


@runtime_checkable
class Tracker(Protocol):
    model: str
    uri: str  # where the store is, without credentials
    local_artifacts: bool  # the store keeps its artifacts on this machine's disk

    def build_run(self, precision: str, *, new: bool = False) -> str:
        """The id of the current run of build `<model>@<precision>`, created when missing or `new` (the
        previous one is then marked superseded)."""
        ...

    def find_run(self, precision: str | None) -> str | None:
        """The current run of build `precision` (None: the summary run), or None; creates nothing."""
        ...

    def logged_digest(self, run_id: str, stage: str) -> str | None:
        """The inputs digest of the stage the run holds as done, or None."""
        ...

    def log_stage(self, run_id: str, manifest: Manifest, files: Iterable[Path]) -> None:
        """A finished stage's metrics, params, tags and files (folders whole); ParamsChanged where a param
        already holds another value."""
        ...

    def mark_failed(self, run_id: str, stage: str, error: str) -> None: ...

    def describe_failure(self, error: Exception) -> str:
        """One line for an error the store raised: what went wrong and the fix, no credentials."""
        ...

    def artifact_uri(self, run_id: str, path: str) -> str: ...

    def has_artifacts(self, run_id: str, path: str) -> bool: ...

    def log_folder(self, run_id: str, folder: Path, artifact_path: str) -> None: ...

    def download(self, run_id: str, path: str, dst: Path, *, skip: tuple[str, ...] = ()) -> Path | None:
        """A run's artifact folder `path` into `dst`/`path` (sub-folders named in `skip` left out); None
        when the run has nothing there."""
        ...

    def shipped(self) -> dict[str, str] | None:
        """The registry version behind alias `ship` (version, run_id, source, precision, description, files: the
        digest of its checkpoint's file list, "" where none was recorded); None when nothing ships."""
        ...

    def download_version(self, alias: str, dst: Path) -> dict[str, str]:
        """The files of the registry version behind `alias` under `dst`, and what it is (as shipped() says)."""
        ...

    def log_verdicts(self, decision: Decision) -> None:
        """The gate's verdict on every build, the baseline's too, on their runs."""
        ...

    def register_ship(
        self, run_id: str, source: str, why: str, card: str = "", files: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Register the chosen build (its checkpoint at `source`) and point alias `ship` at it; its ship card
        (Markdown, pipelines/present/shipcard.py) becomes the version's description and the run's
        `ship/README.md` (without one, the description is `why`); `files`, the checkpoint's files by sha256 as
        the gate judged them, become the run's `ship/files.json` and their digest a tag of the version
        (pipelines/core/system/integrity.py), which `qeval pull` and `qeval verify` check against."""
        ...

    def clear_ship(self) -> None:
        """No build passed: alias `ship` must not keep pointing at an earlier decision."""
        ...

    def log_decision(self, decision: Decision, file: Path) -> str:
        """The policy (params), gate.json and the decision's tags on the summary run, a new one where the
        policy changed; its id."""
        ...

    def log_report(
        self, tables: Mapping[str, Any], files: Iterable[Path], per_build: Mapping[str, Iterable[Path]] | None = None
    ) -> str:
        """The report's tables and files (its charts, as written) on the summary run, and `per_build` files on
        each build's own run (by precision); the summary run's id."""
        ...
