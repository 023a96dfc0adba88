"""A tracker (pipelines/core/framework/tracker.py) that keeps in memory what MLflowTracker writes to a store.

For tests that exercise a stage, the gate or the report but not MLflow. It maps typed results to the same
names (pipelines/tracking/mapping.py), refuses a changed param the same way, supersedes runs, starts a new
summary run when the policy changes, keeps artifacts' bytes and gives them back: tests/test_tracker_contract.py
holds it and MLflowTracker to the same behaviour.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.core.framework.tracker import ParamsChanged
from pipelines.core.store.manifests import Manifest
from pipelines.core.store.verdicts import Decision
from pipelines.core.system.errors import QevalError
from pipelines.core.system.integrity import hashes_digest
from pipelines.tracking.mapping import (
    baseline_metrics,
    build_run_tags,
    decision_params,
    logged,
    stage_digest,
    stage_tags,
    summary_tags,
    verdict_metrics,
    verdict_tags,
)
from pipelines.tracking.names import (
    KIND_SUMMARY,
    PARAM_PRECISION,
    SHIP_ALIAS,
    SHIP_CARD,
    SHIP_FILES,
    TAG_CHOSEN,
    TAG_DIGESTS,
    TAG_KIND,
    TAG_MODEL,
    TAG_PRECISION,
    TAG_STAGE,
    TAG_STAGE_ERROR,
    TAG_SUPERSEDED,
    registered_model_name,
    run_name,
    summary_run_name,
)


@dataclass
class MemoryRun:
    name: str
    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, bytes] = field(default_factory=dict)  # path under the run's artifact root -> content
    status: str = "RUNNING"

    @property
    def files(self) -> list[str]:
        return list(self.artifacts)


class MemoryTracker:
    def __init__(self, model: str):
        self.model = model
        self.uri = "memory"
        self.local_artifacts = True
        self.runs: dict[str, MemoryRun] = {}
        self.versions: list[dict[str, str]] = []
        self.ship: dict[str, str] | None = None

    def run(self, precision: str) -> MemoryRun:
        """The build's current run."""
        return self.runs[self.build_run(precision)]

    # ---- runs ----------------------------------------------------------------------------------------

    def _current(self, tag: str, value: str) -> str | None:
        found = [i for i, r in self.runs.items() if r.tags.get(tag) == value and TAG_SUPERSEDED not in r.tags]
        return found[-1] if found else None

    def _run(self, tag: str, value: str, name: str, new: bool, tags: dict[str, str]) -> str:
        current = self._current(tag, value)
        if current is not None and not new:
            return current
        run_id = f"run-{len(self.runs)}"
        self.runs[run_id] = MemoryRun(name, tags={**tags, tag: value})
        if tag == TAG_PRECISION:
            self.runs[run_id].params[PARAM_PRECISION] = value
        if current is not None:
            self.runs[current].tags[TAG_SUPERSEDED] = run_id
        return run_id

    def build_run(self, precision: str, *, new: bool = False) -> str:
        tags = build_run_tags(self.model, precision)
        return self._run(TAG_PRECISION, precision, run_name(self.model, precision), new, tags)

    def summary_run(self, *, new: bool = False) -> str:
        return self._run(TAG_KIND, KIND_SUMMARY, summary_run_name(self.model), new, {TAG_MODEL: self.model})

    def find_run(self, precision: str | None) -> str | None:
        return self._current(TAG_PRECISION, precision) if precision else self._current(TAG_KIND, KIND_SUMMARY)

    def logged_digest(self, run_id: str, stage: str) -> str | None:
        tags = self.runs[run_id].tags
        return stage_digest(tags, stage) if tags.get(TAG_STAGE.format(stage=stage)) == "done" else None

    # ---- stages --------------------------------------------------------------------------------------

    def log_stage(self, run_id: str, manifest: Manifest, files: Iterable[Path]) -> None:
        run, out = self.runs[run_id], logged(manifest.result)
        if any(k in run.params and run.params[k] != v for k, v in out.params.items()):
            raise ParamsChanged(manifest.stage)
        run.metrics |= out.metrics
        for name, points in out.series.items():
            run.series[name] = run.series.get(name, []) + list(points)
        run.params = {**out.params, **run.params}
        for path in files:  # the files first, then the tag that says done (as MlflowTracker does)
            if path.is_dir():
                self.log_folder(run_id, path, f"{manifest.stage}/{path.name}")
            else:
                run.artifacts[f"{manifest.stage}/{path.name}"] = path.read_bytes()
        run.tags |= out.tags | stage_tags(
            manifest.stage, manifest.inputs_digest, manifest.code, run.tags.get(TAG_DIGESTS)
        )
        run.tags.pop(TAG_STAGE_ERROR.format(stage=manifest.stage), None)
        run.status = "FINISHED"

    def mark_failed(self, run_id: str, stage: str, error: str) -> None:
        self.runs[run_id].tags |= {TAG_STAGE.format(stage=stage): "failed", TAG_STAGE_ERROR.format(stage=stage): error}
        self.runs[run_id].status = "FAILED"

    def describe_failure(self, error: Exception) -> str:
        return f"the in-memory store failed: {type(error).__name__}: {error}"

    # ---- artifacts -----------------------------------------------------------------------------------

    def artifact_uri(self, run_id: str, path: str) -> str:
        return f"memory:/{run_id}/{path}"

    def has_artifacts(self, run_id: str, path: str) -> bool:
        return any(f.startswith(f"{path}/") for f in self.runs[run_id].artifacts)

    def log_folder(self, run_id: str, folder: Path, artifact_path: str) -> None:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                self.runs[run_id].artifacts[f"{artifact_path}/{f.relative_to(folder)}"] = f.read_bytes()

    def download(self, run_id: str, path: str, dst: Path, *, skip: tuple[str, ...] = ()) -> Path | None:
        prefix = f"{path}/"
        chosen = {
            name: data
            for name, data in self.runs[run_id].artifacts.items()
            if name.startswith(prefix) and name[len(prefix) :].split("/")[0] not in skip
        }
        if not chosen:
            return None
        for name, data in chosen.items():
            target = dst / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return dst / path

    # ---- the gate and the registry -------------------------------------------------------------------

    def log_verdicts(self, decision: Decision) -> None:
        base = self.run(decision.policy.baseline)
        base.tags |= verdict_tags(decision, None)
        base.metrics |= baseline_metrics(decision.baseline)
        for b in decision.builds:
            self.run(b.precision).tags |= verdict_tags(decision, b)
            self.run(b.precision).metrics |= verdict_metrics(b)

    def register_ship(
        self, run_id: str, source: str, why: str, card: str = "", files: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        same = [v for v in self.versions if v["run_id"] == run_id and v["source"] == source]
        if same:
            version = same[0]
        else:
            version = {"version": str(len(self.versions) + 1), "run_id": run_id, "source": source}
            self.versions.append(version)
        version["description"] = card or f"Chosen by the gate: {why}"
        if files:
            self.runs[run_id].artifacts[SHIP_FILES] = json.dumps(dict(files), sort_keys=True).encode()
            version["files"] = hashes_digest(files)
        if card:
            self.runs[run_id].artifacts[SHIP_CARD] = card.encode()
        self.runs[run_id].tags[TAG_CHOSEN] = "true"
        self.ship = version
        return {
            "name": registered_model_name(self.model),
            "version": version["version"],
            "alias": SHIP_ALIAS,
            "source": source,
        }

    def clear_ship(self) -> None:
        self.ship = None

    def shipped(self) -> dict[str, str] | None:
        if self.ship is None:
            return None
        precision = self.runs[self.ship["run_id"]].tags.get(TAG_PRECISION, "")
        return {**self.ship, "precision": precision}

    def download_version(self, alias: str, dst: Path) -> dict[str, str]:
        name = registered_model_name(self.model)
        if alias != SHIP_ALIAS or self.ship is None:
            raise QevalError(
                f"no version of {name} has alias '{alias}' in memory; run: qeval gate --model {self.model}"
            )
        run_id, path = self.ship["source"].removeprefix("memory:/").split("/", 1)
        self.download(run_id, path, dst)
        precision = self.runs[run_id].tags.get(TAG_PRECISION, "")
        return {
            "name": name,
            "version": self.ship["version"],
            "alias": alias,
            "run_id": run_id,
            "precision": precision,
            "source": self.ship["source"],
            "description": self.ship.get("description", ""),
            "files": self.ship.get("files", ""),
        }

    def log_decision(self, decision: Decision, file: Path) -> str:
        params = decision_params(decision)
        run_id = self.summary_run()
        existing = self.runs[run_id].params
        if any(k in existing and existing[k] != v for k, v in params.items()):
            run_id = self.summary_run(new=True)  # params are immutable: a changed policy, a new run
        run = self.runs[run_id]
        run.params = {**params, **run.params}
        run.tags |= summary_tags(decision)
        run.artifacts[f"gate/{file.name}"] = file.read_bytes()
        run.status = "FINISHED"
        return run_id

    def log_report(self, tables, files, per_build=None) -> str:
        run = self.runs[self.summary_run()]
        run.artifacts |= {f"report/{n}": b"" for n in tables}
        run.artifacts |= {f"report/{p.name}": p.read_bytes() for p in files}
        for precision, paths in (per_build or {}).items():
            if (build := self.find_run(precision)) is not None:
                self.runs[build].artifacts |= {f"report/{p.name}": p.read_bytes() for p in paths}
        run.status = "FINISHED"
        return self.find_run(None) or ""
