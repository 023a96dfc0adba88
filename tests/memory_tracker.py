"""A stand-in for pipelines.tracking.MlflowTracker that keeps what would be logged in memory.

For tests that exercise a stage, the gate or the report but not MLflow: it maps typed results to the
same names (pipelines/mlflow_names.py's pure functions) and refuses a changed param the same way, without
opening a store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.mlflow_names import (
    PARAM_PRECISION,
    SHIP_ALIAS,
    TAG_CHOSEN,
    TAG_DIGESTS,
    TAG_STAGE,
    TAG_STAGE_ERROR,
    baseline_metrics,
    decision_params,
    logged,
    registered_model_name,
    run_name,
    stage_digest,
    stage_tags,
    summary_run_name,
    summary_tags,
    verdict_metrics,
    verdict_tags,
)
from pipelines.results import Decision, Manifest
from pipelines.tracking import ParamsChanged


@dataclass
class MemoryRun:
    name: str
    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


class MemoryTracker:
    def __init__(self, model: str):
        self.model = model
        self.uri = "memory"
        self.runs: dict[str, MemoryRun] = {}
        self.current: dict[str, str] = {}
        self.ship: dict[str, str] | None = None

    def run(self, precision: str) -> MemoryRun:
        """The build's current run."""
        return self.runs[self.build_run(precision)]

    def build_run(self, precision: str, *, new: bool = False) -> str:
        run_id = self._run(run_name(self.model, precision), new)
        self.runs[run_id].params.setdefault(PARAM_PRECISION, precision)
        return run_id

    def _run(self, name: str, new: bool = False) -> str:
        if name not in self.current or new:
            self.current[name] = f"run-{len(self.runs)}"
            self.runs[self.current[name]] = MemoryRun(name)
        return self.current[name]

    def stage_is_logged(self, run_id: str, stage: str, digest: str) -> bool:
        return stage_digest(self.runs[run_id].tags, stage) == digest

    def find_run(self, precision: str | None) -> str | None:
        return None  # it holds no files: the local artifacts/ are all there is (pipelines/sync.py reads nothing)

    def shipped(self) -> dict[str, str] | None:
        return None

    def has_artifacts(self, run_id: str, path: str) -> bool:
        return any(f.startswith(f"{path}/") for f in self.runs[run_id].files)

    def log_folder(self, run_id: str, folder: Path, artifact_path: str) -> None:
        files = [f for f in folder.rglob("*") if f.is_file()]
        self.runs[run_id].files += [f"{artifact_path}/{f.relative_to(folder)}" for f in files]

    def artifact_uri(self, run_id: str, path: str) -> str:
        return f"memory:/{run_id}/{path}"

    def log_stage(self, run_id: str, manifest: Manifest, files: Iterable[Path]) -> None:
        run, out = self.runs[run_id], logged(manifest.result)
        if any(run.params.get(k, v) != v for k, v in out.params.items()):
            raise ParamsChanged(manifest.stage)
        run.metrics |= out.metrics
        run.series |= out.series
        run.params |= out.params
        run.tags |= stage_tags(manifest.stage, manifest.inputs_digest, manifest.code, run.tags.get(TAG_DIGESTS))
        run.files += [f"{manifest.stage}/{p.name}" for p in files]

    def mark_failed(self, run_id: str, stage: str, error: str) -> None:
        self.runs[run_id].tags |= {TAG_STAGE.format(stage=stage): "failed", TAG_STAGE_ERROR.format(stage=stage): error}

    def log_verdicts(self, decision: Decision) -> None:
        base = self.run(decision.policy.baseline)
        base.tags |= verdict_tags(decision, None)
        base.metrics |= baseline_metrics(decision.baseline)
        for b in decision.builds:
            self.run(b.precision).tags |= verdict_tags(decision, b)
            self.run(b.precision).metrics |= verdict_metrics(b)

    def register_ship(self, run_id: str, source: str, why: str) -> dict[str, str]:
        self.runs[run_id].tags[TAG_CHOSEN] = "true"
        self.ship = {"name": registered_model_name(self.model), "version": "1", "alias": SHIP_ALIAS, "source": source}
        return self.ship

    def clear_ship(self) -> None:
        self.ship = None

    def log_decision(self, decision: Decision, file: Path) -> str:
        run = self.runs[self._run(summary_run_name(self.model))]
        run.params |= decision_params(decision)
        run.tags |= summary_tags(decision)
        run.files.append(f"gate/{file.name}")
        return self.current[run.name]

    def log_report(self, figures, tables, files) -> str:
        run = self.runs[self._run(summary_run_name(self.model))]
        run.files += [f"report/{n}" for n in [*figures, *tables, *(p.name for p in files)]]
        return self.current[run.name]
