"""Every MLflow name qeval writes that is not a stage's figure: experiment, runs, tags, params of the UI, the
gate's, the registry alias. A stage's figures are declared beside its result type (pipelines/core/store/results/,
its `LOGS`); pipelines/tracking/tables.py lists them all (`names()`, what docs/mlflow.md's "MLflow layout" gives).

One experiment per model (`qeval/<model>`), one run per build (`<model>@<precision>`); each stage adds
its metrics, params and artifacts to that run and sets the tag `qeval.stage.<stage>` to `done` or
`failed`. A summary run per model holds the gate's policy, its decision and the report.
"""

from __future__ import annotations

EXPERIMENT = "qeval/<model>"
EXPERIMENT_KIND_TAG = ("mlflow.experimentKind", "custom_model_development")
# Set by qeval for MLflow's own UI: the run's note ("Description"), the colour its dot and chart lines get,
# and a saved view of the runs page (columns and charts) that `qeval ui`'s link opens.
TAG_DESCRIPTION, TAG_RUN_COLOUR = "mlflow.note.content", "mlflow.runColor"
VIEW_KEY = "qeval"
TAG_VIEW = "mlflow.sharedViewState." + VIEW_KEY
PARAM_PRECISION = "precision"
TAG_MODEL, TAG_PRECISION = "qeval.model", "qeval.precision"
TAG_KIND, KIND_SUMMARY = "qeval.kind", "summary"
TAG_SUPERSEDED = "qeval.superseded_by"
TAG_VERDICT, TAG_REASONS, TAG_CHOSEN = "qeval.gate.verdict", "qeval.gate.reasons", "qeval.gate.chosen"
TAG_SHIPS = "qeval.chosen"  # on the summary run: the precision that ships, or none
TAG_COMMIT, TAG_DIRTY = "mlflow.source.git.commit", "qeval.git_dirty"
TAG_STAGE, TAG_STAGE_ERROR = "qeval.stage.{stage}", "qeval.stage.{stage}.error"
TAG_NOT_RUN = "qeval.stage.{stage}.not_run"  # what the card asked of the stage that it could not do, and why
TAG_DIGESTS = "qeval.digests"  # {stage: cache key} as JSON: one tag, not one per stage in the run page's tags
SHIP_ALIAS = "ship"
TAG_FILES = "qeval.checkpoint_files_sha256"  # on a registered version: its checkpoint's file list, as gated
SHIP_FILES = "ship/files.json"  # the shipped checkpoint's files (name -> sha256), on its run, as gated
SHIP_CARD = "ship/README.md"  # the shipped build's card, on its run (also the registered version's description)
# MLflow's SQL store keeps a model version's description in 5,000 characters (mlflow/store/model_registry/
# dbmodels/models.py, SqlModelVersion.description: String(5000)); PostgreSQL refuses a longer one.
MAX_DESCRIPTION = 5000
MAX_TAG = 5000  # MLflow's limit on a tag value is 8000 characters; keep errors well inside it.

GATE_PARAM = "gate.{key}"  # the summary run: one per policy key

# the gate's headline figures on every build's run, which the runs page's saved view shows (view.py)
GATE_RECOVERY_WORST, GATE_RECOVERY_WORST_LOWER = "gate/recovery_worst", "gate/recovery_worst_lower"
GATE_SPEED, GATE_WEIGHTS_GB, GATE_USERS_AT_SLO = "gate/speed", "gate/weights_gb", "gate/users_at_slo"


def experiment_name(model: str) -> str:
    return EXPERIMENT.replace("<model>", model)


def run_name(model: str, precision: str) -> str:
    return f"{model}@{precision}"


def summary_run_name(model: str) -> str:
    return f"{model}: gate and report"


def registered_model_name(model: str) -> str:
    return f"qeval-{model}"
