"""MLflow: the only module that imports mlflow; it writes the names of names.py and tables.py to the store.

The store is $MLFLOW_TRACKING_URI, else SQLite at mlruns/mlflow.db with artifacts under mlruns/artifacts/
(store.py: the address, its credentials, its health check, and errors without secrets). MlflowTracker
implements the tracker protocol (pipelines/core/framework/tracker.py) that the stages, the gate and the report log
through; tests that are not about MLflow pass one that keeps the same in memory (tests/memory_tracker.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from pathlib import Path
from urllib.parse import urlparse

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
    EXPERIMENT_KIND_TAG,
    KIND_SUMMARY,
    MAX_DESCRIPTION,
    MAX_TAG,
    PARAM_PRECISION,
    SHIP_ALIAS,
    SHIP_CARD,
    SHIP_FILES,
    TAG_CHOSEN,
    TAG_DIGESTS,
    TAG_FILES,
    TAG_KIND,
    TAG_MODEL,
    TAG_PRECISION,
    TAG_STAGE,
    TAG_STAGE_ERROR,
    TAG_SUPERSEDED,
    TAG_VIEW,
    experiment_name,
    registered_model_name,
    run_name,
    summary_run_name,
)
from pipelines.tracking.store import (
    HTTP_DEFAULTS,
    check_artifact_root,
    check_server,
    redact,
    scrub,
    sqlite_path,
    store_error,
    store_lock,
    tracking_uri,
    without_credentials,
)
from pipelines.tracking.view import runs_view

log = logging.getLogger(__name__)


def experiment_ids() -> dict[str, str]:
    """Model -> experiment id, for every qeval experiment in the store (none when there is no store yet)."""
    uri = without_credentials(tracking_uri())
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        return {}
    from mlflow.tracking import MlflowClient

    prefix = experiment_name("")
    found = MlflowClient(tracking_uri=uri).search_experiments(filter_string=f"name LIKE '{prefix}%'")
    return {e.name.removeprefix(prefix): e.experiment_id for e in sorted(found, key=lambda e: e.name)}


class MlflowTracker:
    """A handle on the MLflow store for one model's experiment (the tracker protocol,
    pipelines/core/framework/tracker.py)."""

    def __init__(self, model: str, uri: str | None = None):
        self.model = model
        self.uri = without_credentials(uri or tracking_uri())
        db = sqlite_path(self.uri)
        if self.uri.startswith(("http://", "https://")):
            for name, value in HTTP_DEFAULTS.items():
                os.environ.setdefault(name, value)
            check_server(self.uri)
        try:
            if db is not None:
                db.parent.mkdir(parents=True, exist_ok=True)
                with open(db, "ab"):
                    pass
            with store_lock(self.uri):
                from mlflow.tracking import MlflowClient

                self.client = MlflowClient(tracking_uri=self.uri)
                self.experiment_id = self._experiment()
                where = urlparse(self.client.get_experiment(self.experiment_id).artifact_location or "")
                self.local_artifacts = where.scheme in ("", "file")
        except QevalError:
            raise
        except Exception as e:  # any failure here means the store cannot be used
            msg = scrub(str(e).strip().splitlines()[0]) if str(e).strip() else type(e).__name__
            raise QevalError(
                f"MLflow store {redact(self.uri)} is not usable: {msg}; set MLFLOW_TRACKING_URI "
                f"or QEVAL_WORKDIR to a writable place"
            ) from None

    def _experiment(self) -> str:
        name = experiment_name(self.model)
        view = json.dumps(runs_view(), sort_keys=True)
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            check_artifact_root(self.uri, exp.artifact_location)
            if exp.tags.get(TAG_VIEW) != view:  # a store made by an earlier qeval gets this one's view
                self.client.set_experiment_tag(exp.experiment_id, TAG_VIEW, view)
            return exp.experiment_id
        db = sqlite_path(self.uri)
        location = str(db.parent / "artifacts" / self.model) if db is not None else None
        return self.client.create_experiment(
            name, artifact_location=location, tags=dict([EXPERIMENT_KIND_TAG, (TAG_VIEW, view)])
        )

    def build_run(self, precision: str, *, new: bool = False) -> str:
        """The id of the current run of build `<model>@<precision>`, created when missing or `new`."""
        tags = build_run_tags(self.model, precision)
        return self._current_run(TAG_PRECISION, precision, run_name(self.model, precision), new, tags)

    def summary_run(self, *, new: bool = False) -> str:
        """The model's gate-and-report run (policy, decision, charts), beside the one run per build."""
        return self._current_run(TAG_KIND, KIND_SUMMARY, summary_run_name(self.model), new, {TAG_MODEL: self.model})

    def _find(self, tag: str, value: str) -> str | None:
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{tag}` = '{value}'", order_by=["attributes.start_time DESC"]
        )
        return next((r.info.run_id for r in runs if TAG_SUPERSEDED not in r.data.tags), None)

    def find_run(self, precision: str | None) -> str | None:
        """The current run of build `precision` (None: the summary run), or None; creates nothing."""
        return self._find(TAG_PRECISION, precision) if precision else self._find(TAG_KIND, KIND_SUMMARY)

    def _current_run(self, tag: str, value: str, name: str, new: bool, tags: dict[str, str]) -> str:
        with store_lock(self.uri):
            current = self._find(tag, value)
            if current is not None and not new:
                return current
            run = self.client.create_run(self.experiment_id, run_name=name, tags={**tags, tag: value})
            if tag == TAG_PRECISION:  # a build's run, made by a stage or by the gate: its precision as a param
                self.client.log_param(run.info.run_id, PARAM_PRECISION, value)
            if current is not None:  # kept, restorable, under the UI's "State: Deleted"
                self.client.set_tag(current, TAG_SUPERSEDED, run.info.run_id)
                self.client.delete_run(current)
            return run.info.run_id

    def logged_digest(self, run_id: str, stage: str) -> str | None:
        """The inputs digest of the stage the run holds as done, or None."""
        tags = self.client.get_run(run_id).data.tags
        return stage_digest(tags, stage) if tags.get(TAG_STAGE.format(stage=stage)) == "done" else None

    # ---- the store as the system of record: what other machines read back ----------------------------

    def artifact_uri(self, run_id: str, path: str) -> str:
        """Where a run's artifact lives, as the store names it (a path, or mlflow-artifacts:/... when proxied)."""
        return f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{path}"

    def has_artifacts(self, run_id: str, path: str) -> bool:
        return bool(self.client.list_artifacts(run_id, path))

    def log_folder(self, run_id: str, folder: Path, artifact_path: str) -> None:
        self.client.log_artifacts(run_id, str(folder), artifact_path=artifact_path)

    def download(self, run_id: str, path: str, dst: Path, *, skip: tuple[str, ...] = ()) -> Path | None:
        """A run's artifact folder `path` into `dst`/`path` (sub-folders named in `skip` left out); None
        when the run has nothing there."""
        entries = [e for e in self.client.list_artifacts(run_id, path) if Path(e.path).name not in skip]
        if not entries:
            return None
        folder = dst / path
        folder.mkdir(parents=True, exist_ok=True)
        for e in entries:  # MLflow puts each entry under its own name in the folder it is given
            self.client.download_artifacts(run_id, e.path, str(folder))
        return folder

    def shipped(self) -> dict[str, str] | None:
        """The registry version behind alias `ship`: its version, run, source and the run's build; None
        when nothing ships."""
        from mlflow.exceptions import MlflowException

        try:
            v = self.client.get_model_version_by_alias(registered_model_name(self.model), SHIP_ALIAS)
        except MlflowException:
            return None
        precision = self.client.get_run(v.run_id).data.tags.get(TAG_PRECISION, "") if v.run_id else ""
        return {
            "version": str(v.version),
            "run_id": v.run_id or "",
            "source": v.source,
            "precision": precision,
            "description": v.description or "",
            "files": v.tags.get(TAG_FILES, ""),
        }

    def download_version(self, alias: str, dst: Path) -> dict[str, str]:
        """The files of the registry version behind `alias`, under the folder `dst`."""
        import mlflow.artifacts
        from mlflow.exceptions import MlflowException

        name = registered_model_name(self.model)
        try:
            v = self.client.get_model_version_by_alias(name, alias)
        except MlflowException:
            raise QevalError(
                f"no version of {name} has alias '{alias}' in {redact(self.uri)}; run: qeval gate --model {self.model}"
            ) from None
        # the version's source as the registry holds it (what `models:/<name>@<alias>` resolves to)
        mlflow.artifacts.download_artifacts(artifact_uri=v.source, dst_path=str(dst), tracking_uri=self.uri)
        precision = self.client.get_run(v.run_id).data.tags.get(TAG_PRECISION, "") if v.run_id else ""
        return {
            "name": name,
            "version": str(v.version),
            "alias": alias,
            "run_id": v.run_id or "",
            "precision": precision,
            "source": scrub(v.source),
            "description": v.description or "",
            "files": v.tags.get(TAG_FILES, ""),
        }

    def _batch(self, run_id: str, metrics=None, series=None, params=None, tags=None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
            + [Metric(k, float(v), now, int(step)) for k, points in (series or {}).items() for step, v in points],
            params=[Param(k, v) for k, v in (params or {}).items()],
            tags=[RunTag(k, v) for k, v in (tags or {}).items()],
        )

    def log_stage(self, run_id: str, manifest: Manifest, files: Iterable[Path]) -> None:
        """Log a finished stage; ParamsChanged when a param already holds another value."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.exceptions import MlflowException

        stage, out = manifest.stage, logged(manifest.result)
        data = self.client.get_run(run_id).data
        if any(k in data.params and data.params[k] != v for k, v in out.params.items()):
            raise ParamsChanged(stage)
        try:
            params = {PARAM_PRECISION: manifest.precision, **out.params}
            new_params = {k: v for k, v in params.items() if k not in data.params}
            self._batch(run_id, out.metrics, out.series, new_params)
            if out.datasets:
                self.client.log_inputs(
                    run_id,
                    datasets=[
                        DatasetInput(
                            Dataset(  # MLflow caps digests at 36 characters; the source JSON has all 64
                                name,
                                str(d.get("sha256") or "none")[:36],
                                "local" if d.get("files") else "hub",
                                json.dumps(d, sort_keys=True),
                            ),
                            tags=[InputTag("mlflow.data.context", stage)],
                        )
                        for name, d in out.datasets.items()
                    ],
                )
            for path in files:
                if path.is_dir():
                    self.client.log_artifacts(run_id, str(path), artifact_path=f"{stage}/{path.name}")
                else:
                    self.client.log_artifact(run_id, str(path), artifact_path=stage)
            # tagged done only once every file is up: a crash during the upload leaves the stage not done
            done = stage_tags(stage, manifest.inputs_digest, manifest.code, data.tags.get(TAG_DIGESTS))
            self._batch(run_id, tags={**out.tags, **done})
            if TAG_STAGE_ERROR.format(stage=stage) in data.tags:
                self.client.delete_tag(run_id, TAG_STAGE_ERROR.format(stage=stage))
            self.client.set_terminated(run_id, "FINISHED")
        except MlflowException as e:
            raise QevalError(f"could not log stage '{stage}' to MLflow: {e.message.splitlines()[0]}") from None

    def describe_failure(self, error: Exception) -> str:
        return store_error(self.uri, error)

    def mark_failed(self, run_id: str, stage: str, error: str) -> None:
        self.client.set_tag(run_id, TAG_STAGE.format(stage=stage), "failed")
        self.client.set_tag(run_id, TAG_STAGE_ERROR.format(stage=stage), error[:MAX_TAG])
        self.client.set_terminated(run_id, "FAILED")

    def log_verdicts(self, decision: Decision) -> None:
        """The gate's verdict on every build (tags and `gate/*` metrics), the baseline's too."""
        self._batch(
            self.build_run(decision.policy.baseline),
            baseline_metrics(decision.baseline),
            tags=verdict_tags(decision, None),
        )
        for b in decision.builds:
            self._batch(self.build_run(b.precision), verdict_metrics(b), tags=verdict_tags(decision, b))

    def register_ship(
        self, run_id: str, source: str, why: str, card: str = "", files: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Register the chosen build as a version of `qeval-<model>` and point alias `ship` at it.

        A build registered before from the same run and checkpoint keeps its version. Everything a reader
        of the alias needs (description, files record, ship card) is written first and the alias moved
        last, so a gate that dies on the way leaves `ship` where it was."""
        from mlflow.exceptions import MlflowException

        name = registered_model_name(self.model)
        with store_lock(self.uri):
            try:
                self.client.get_registered_model(name)
            except MlflowException:
                self.client.create_registered_model(
                    name, tags={TAG_MODEL: self.model}, description=f"Builds of {self.model} that passed the qeval gate"
                )
            same = [v for v in self.client.search_model_versions(f"name='{name}'") if v.run_id == run_id]
            same = [
                v for v in same if v.source == source and (not files or v.tags.get(TAG_FILES) == hashes_digest(files))
            ]
            version = same[0] if same else self.client.create_model_version(name, source, run_id=run_id)
            self.client.update_model_version(name, version.version, description=_description(card, why, run_id))
            if files:
                self.client.log_text(run_id, json.dumps(dict(files), indent=1, sort_keys=True), SHIP_FILES)
                self.client.set_model_version_tag(name, version.version, TAG_FILES, hashes_digest(files))
            if card:
                self.client.log_text(run_id, card, SHIP_CARD)
            self.client.set_tag(run_id, TAG_CHOSEN, "true")
            self.client.set_registered_model_alias(name, SHIP_ALIAS, version.version)  # last: see above
        return {"name": name, "version": str(version.version), "alias": SHIP_ALIAS, "source": source}

    def clear_ship(self) -> None:
        """No build passed: the alias `ship` must not keep pointing at an earlier decision."""
        from mlflow.exceptions import MlflowException

        with suppress(MlflowException):  # no registered model or no alias yet
            self.client.delete_registered_model_alias(registered_model_name(self.model), SHIP_ALIAS)

    def log_decision(self, decision: Decision, file: Path) -> str:
        """The policy (params), gate.json and the decision's tags on the model's summary run."""
        params = decision_params(decision)

        def write(run_id: str) -> str:
            existing = self.client.get_run(run_id).data.params
            if any(k in existing and existing[k] != v for k, v in params.items()):
                run_id, existing = self.summary_run(new=True), {}  # params are immutable: a changed policy, a new run
            self._batch(
                run_id, params={k: v for k, v in params.items() if k not in existing}, tags=summary_tags(decision)
            )
            self.client.log_artifact(run_id, str(file), artifact_path="gate")
            self.client.set_terminated(run_id, "FINISHED")
            return run_id

        return self._on_summary(write)

    def log_report(self, tables, files, per_build=None) -> str:
        """Tables and files of the report (its charts as the report wrote them: one rendering, the same bytes in
        the folder and the store), on the model's summary run; `per_build` files on each build's run too."""
        for precision, paths in (per_build or {}).items():
            if (build := self.find_run(precision)) is not None:
                for path in paths:
                    self.client.log_artifact(build, str(path), artifact_path="report")

        def write(run_id: str) -> str:
            for name, table in tables.items():
                self.client.log_table(run_id, data=dict(table), artifact_file=f"report/{name}")
            for path in files:
                self.client.log_artifact(run_id, str(path), artifact_path="report")
            self.client.set_terminated(run_id, "FINISHED")
            return run_id

        return self._on_summary(write)

    def _on_summary(self, write: Callable[[str], str]) -> str:
        """`write` on the summary run; where another process (a gate with a changed policy) replaced that run
        meanwhile, MLflow refuses writes to the old one (it is deleted): written again on the new one."""
        from mlflow.exceptions import MlflowException

        for attempt in range(3):
            try:
                return write(self.summary_run())
            except MlflowException as e:
                if "must be in the 'active' state" not in str(e) or attempt == 2:
                    raise
        raise AssertionError("unreachable")


def _description(card: str, why: str, run_id: str) -> str:
    """A registered version's description: its ship card, cut to what the registry keeps (the whole card is
    `ship/README.md` on the run, which `qeval card` and `qeval pull` read)."""
    text = card or f"Chosen by the gate: {why}"
    if len(text) <= MAX_DESCRIPTION:
        return text
    note = f"\n\n(cut to the registry's {MAX_DESCRIPTION:,} characters; the whole card: {SHIP_CARD} on run {run_id})"
    return text[: MAX_DESCRIPTION - len(note)] + note
