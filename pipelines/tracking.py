"""The MLflow contract (shared/DESIGN.md): the only module that imports mlflow.

One experiment per model (`qeval/<model>`), one run per build (`<model>@<precision>`); each stage adds
its metrics, params and artifacts to that run and sets the tag `qeval.stage.<stage>` to `done` or
`failed`. The store is $MLFLOW_TRACKING_URI, else SQLite at mlruns/mlflow.db with artifacts under
mlruns/artifacts/.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pipelines.errors import QevalError
from pipelines.paths import mlruns_dir

log = logging.getLogger(__name__)

EXPERIMENT_KIND_TAG = ("mlflow.experimentKind", "custom_model_development")
TAG_MODEL, TAG_PRECISION = "qeval.model", "qeval.precision"
TAG_SUPERSEDED = "qeval.superseded_by"
TAG_KIND, KIND_SUMMARY = "qeval.kind", "summary"
TAG_VERDICT, TAG_REASONS, TAG_CHOSEN = "qeval.gate.verdict", "qeval.gate.reasons", "qeval.gate.chosen"
SHIP_ALIAS = "ship"
_MAX_TAG = 5000  # MLflow's limit on a tag value is 8000 characters; keep errors well inside it.


def stage_tag(stage: str) -> str:
    return f"qeval.stage.{stage}"


def experiment_name(model: str) -> str:
    return f"qeval/{model}"


def run_name(model: str, precision: str) -> str:
    return f"{model}@{precision}"


def summary_run_name(model: str) -> str:
    return f"{model}: gate and report"


def registered_model_name(model: str) -> str:
    return f"qeval-{model}"


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else the SQLite store under mlruns/."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{mlruns_dir() / 'mlflow.db'}"


def redact(uri: str) -> str:
    """The URI without user name or password, for messages."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def metric_key(task: str, lm_eval_key: str, prefix: str = "eval") -> str | None:
    """lm-eval's `acc,none` -> `eval/<task>/acc`; `em,strict-match` -> `eval/<task>/em/strict-match`.

    None for keys that are not metrics (`alias`, `samples`). MLflow refuses commas in names.
    """
    if "," not in lm_eval_key:
        return None
    metric, _, filt = lm_eval_key.partition(",")
    name = metric if filt in ("", "none") else f"{metric}/{filt}"
    return f"{prefix}/{task}/{re.sub(r'[^A-Za-z0-9_./ -]', '_', name)}"


def lm_eval_metrics(results: Mapping[str, Mapping[str, object]], prefix: str = "eval") -> dict[str, float]:
    """Flatten lm-eval's `results` section (or one keyed like it) to MLflow metrics; "N/A" stderrs are left out."""
    out: dict[str, float] = {}
    for task, values in results.items():
        for key, value in values.items():
            name = metric_key(task, key, prefix)
            if name is None or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                out[name] = float(value)
    return out


def ui_command(host: str, port: int | str) -> list[str]:
    """The command that serves the MLflow UI over the store."""
    uri = tracking_uri()
    db = _sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        host,
        "--port",
        str(port),
    ]


class ParamsChanged(Exception):
    """A stage reran with other settings: MLflow params are immutable, so the build needs a new run."""


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


@contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Serialise store creation and experiment/run creation between processes sharing a SQLite store.

    Twelve processes creating a fresh MLflow database at once all failed (shared/TOOLCHAIN.md).
    """
    db = _sqlite_path(uri)
    if db is None:
        yield
        return
    with open(db.parent / ".qeval.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class Tracker:
    """A handle on the MLflow store for one model's experiment."""

    def __init__(self, model: str, uri: str | None = None):
        self.model = model
        self.uri = uri or tracking_uri()
        db = _sqlite_path(self.uri)
        try:
            if db is not None:
                db.parent.mkdir(parents=True, exist_ok=True)
                with open(db, "ab"):
                    pass
            with _store_lock(self.uri):
                from mlflow.tracking import MlflowClient

                logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its migration chatter

                self.client = MlflowClient(tracking_uri=self.uri)
                self.experiment_id = self._experiment()
        except Exception as e:  # any failure here means the store cannot be used
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise QevalError(
                f"MLflow store {redact(self.uri)} is not usable: {msg}; set MLFLOW_TRACKING_URI "
                f"or QEVAL_WORKDIR to a writable place"
            ) from None

    def _artifact_location(self) -> str | None:
        db = _sqlite_path(self.uri)
        return str(db.parent / "artifacts" / self.model) if db is not None else None

    def _experiment(self) -> str:
        name = experiment_name(self.model)
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        return self.client.create_experiment(
            name, artifact_location=self._artifact_location(), tags=dict([EXPERIMENT_KIND_TAG])
        )

    def build_run(self, precision: str, *, new: bool = False) -> str:
        """The id of the current run of build `<model>@<precision>`, created when missing or `new`."""
        return self._current_run(TAG_PRECISION, precision, run_name(self.model, precision), new)

    def summary_run(self, *, new: bool = False) -> str:
        """The model's gate-and-report run (policy, decision, charts), beside the one run per build."""
        return self._current_run(TAG_KIND, KIND_SUMMARY, summary_run_name(self.model), new)

    def _current_run(self, tag: str, value: str, name: str, new: bool) -> str:
        with _store_lock(self.uri):
            current = self._find_run(tag, value)
            if current is not None and not new:
                return current
            run = self.client.create_run(self.experiment_id, run_name=name, tags={TAG_MODEL: self.model, tag: value})
            if current is not None:  # kept, restorable, under the UI's "State: Deleted"
                self.client.set_tag(current, TAG_SUPERSEDED, run.info.run_id)
                self.client.delete_run(current)
            return run.info.run_id

    def find_run(self, precision: str) -> str | None:
        return self._find_run(TAG_PRECISION, precision)

    def _find_run(self, tag: str, value: str) -> str | None:
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{tag}` = '{value}'",
            order_by=["attributes.start_time DESC"],
        )
        live = [r for r in runs if TAG_SUPERSEDED not in r.data.tags]
        return live[0].info.run_id if live else None

    def stage_is_logged(self, run_id: str, stage: str, digest: str) -> bool:
        tags = self.client.get_run(run_id).data.tags
        return tags.get(stage_tag(stage)) == "done" and tags.get(f"{stage_tag(stage)}.digest") == digest

    def log_stage(
        self,
        run_id: str,
        stage: str,
        digest: str,
        metrics: Mapping[str, float],
        params: Mapping[str, str],
        files: Iterable[Path] = (),
        series: Mapping[str, Iterable[tuple[int, float]]] | None = None,
        datasets: Mapping[str, Mapping[str, object]] | None = None,
    ) -> None:
        """Log a finished stage; ParamsChanged when a param already holds another value."""
        from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
        from mlflow.exceptions import MlflowException

        now = int(time.time() * 1000)
        data = self.client.get_run(run_id).data
        existing = data.params
        if any(k in existing and existing[k] != str(v) for k, v in params.items()):
            raise ParamsChanged(stage)
        try:
            self.client.log_batch(
                run_id,
                metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()]
                + [Metric(k, float(v), now, int(step)) for k, points in (series or {}).items() for step, v in points],
                params=[Param(k, str(v)) for k, v in params.items() if k not in existing],
                tags=[RunTag(stage_tag(stage), "done"), RunTag(f"{stage_tag(stage)}.digest", digest)],
            )
            if datasets:
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
                        for name, d in datasets.items()
                    ],
                )
            for path in files:
                if path.is_dir():
                    self.client.log_artifacts(run_id, str(path), artifact_path=f"{stage}/{path.name}")
                else:
                    self.client.log_artifact(run_id, str(path), artifact_path=stage)
            if f"{stage_tag(stage)}.error" in data.tags:
                self.client.delete_tag(run_id, f"{stage_tag(stage)}.error")
            self.client.set_terminated(run_id, "FINISHED")
        except MlflowException as e:
            raise QevalError(f"could not log stage '{stage}' to MLflow: {e.message.splitlines()[0]}") from None

    def mark_failed(self, run_id: str, stage: str, error: str) -> None:
        self.client.set_tag(run_id, stage_tag(stage), "failed")
        self.client.set_tag(run_id, f"{stage_tag(stage)}.error", error[:_MAX_TAG])
        self.client.set_terminated(run_id, "FAILED")

    def tag_build(self, run_id: str, verdict: str, reasons: list[str], metrics: Mapping[str, float]) -> None:
        """The gate's verdict on a build, its reasons one per line, and its headline figures (`gate/*`)."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items() if v is not None and math.isfinite(v)],
            tags=[
                RunTag(TAG_VERDICT, verdict),
                RunTag(TAG_REASONS, "\n".join(reasons)[:_MAX_TAG]),
                RunTag(TAG_CHOSEN, "false"),  # register_ship() marks the one that ships
            ],
        )

    def register_ship(self, run_id: str, source: str, why: str) -> dict[str, str]:
        """Register the chosen build as a version of `qeval-<model>` and point alias `ship` at it.

        A build registered before from the same run and checkpoint keeps its version.
        """
        from mlflow.exceptions import MlflowException

        name = registered_model_name(self.model)
        with _store_lock(self.uri):
            try:
                self.client.get_registered_model(name)
            except MlflowException:
                self.client.create_registered_model(
                    name, tags={TAG_MODEL: self.model}, description=f"Builds of {self.model} that passed the qeval gate"
                )
            same = [v for v in self.client.search_model_versions(f"name='{name}'") if v.run_id == run_id]
            same = [v for v in same if v.source == source]
            version = same[0] if same else self.client.create_model_version(name, source, run_id=run_id)
            self.client.set_registered_model_alias(name, SHIP_ALIAS, version.version)
            self.client.update_model_version(name, version.version, description=f"Chosen by the gate: {why}")
        self.client.set_tag(run_id, TAG_CHOSEN, "true")
        return {"name": name, "version": str(version.version), "alias": SHIP_ALIAS, "source": source}

    def clear_ship(self) -> None:
        """No build passed: the alias `ship` must not keep pointing at an earlier decision."""
        from mlflow.exceptions import MlflowException

        with suppress(MlflowException):  # no registered model or no alias yet
            self.client.delete_registered_model_alias(registered_model_name(self.model), SHIP_ALIAS)

    def log_summary(self, params: Mapping[str, object], file: Path, artifact_path: str, **tags: str) -> str:
        """Log the gate's policy (params), a result file and tags to the model's summary run."""
        flat = {f"gate.{k}": json.dumps(v) if isinstance(v, dict | list) else str(v) for k, v in params.items()}
        run_id = self.summary_run()
        existing = self.client.get_run(run_id).data.params
        if any(k in existing and existing[k] != v for k, v in flat.items()):
            run_id = self.summary_run(new=True)  # params are immutable: a changed policy starts a new run
        from mlflow.entities import Param, RunTag

        self.client.log_batch(
            run_id,
            params=[Param(k, v) for k, v in flat.items() if k not in existing],
            tags=[RunTag(f"qeval.{k}", v) for k, v in tags.items()],
        )
        self.client.log_artifact(run_id, str(file), artifact_path=artifact_path)
        self.client.set_terminated(run_id, "FINISHED")
        return run_id

    def log_report(
        self, figures: Mapping[str, object], tables: Mapping[str, Mapping[str, list]], files: Iterable[Path]
    ):
        """Charts (matplotlib figures), tables and files of the report, on the model's summary run."""
        run_id = self.summary_run()
        for name, fig in figures.items():
            self.client.log_figure(run_id, fig, f"report/{name}")
        for name, table in tables.items():
            self.client.log_table(run_id, data=dict(table), artifact_file=f"report/{name}")
        for path in files:
            self.client.log_artifact(run_id, str(path), artifact_path="report")
        self.client.set_terminated(run_id, "FINISHED")
        return run_id
