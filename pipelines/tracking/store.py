"""The tracking store's address: where it is, its credentials kept out of sight, its health, its errors; the
lock its writers share, and the command that serves its UI.

$MLFLOW_TRACKING_URI, else SQLite at mlruns/mlflow.db. Credentials in an HTTP URI move to MLflow's own
variables, so that nothing qeval or MLflow prints carries them; every message shows the URI redacted.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import locked
from pipelines.core.system.net import Unreachable, probe, redact, scrub
from pipelines.core.system.paths import mlruns_dir


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else the SQLite store under mlruns/."""
    return os.environ.get("MLFLOW_TRACKING_URI") or sqlite_store(mlruns_dir())


def sqlite_store(mlruns: Path) -> str:
    """The address of the default store in folder `mlruns` (a work folder's mlruns/, paths.mlruns_dir)."""
    return f"sqlite:///{mlruns / 'mlflow.db'}"


HEALTH_TIMEOUT_S = 5.0  # a tracking server that does not answer /health within this is not used
# MLflow's own HTTP client retries 7 times with backoff (about 4 minutes against a dead server) and waits
# 120 s per request; qeval checks the server first, so later requests get fewer, shorter tries
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def without_credentials(uri: str) -> str:
    """The URI without user name and password, which move to MLflow's own variables for its HTTP client:
    nothing MLflow prints (its "View run ... at:" lines, its errors) then carries them."""
    parts = urlsplit(uri)
    if not (parts.username or parts.password):
        return uri
    if parts.username:
        os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parts.username)
    if parts.password:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parts.password)
    return urlunsplit(parts._replace(netloc=(parts.hostname or "") + (f":{parts.port}" if parts.port else "")))


def check_server(uri: str) -> None:
    """One quick look at an HTTP tracking server before any work: it must answer /health in seconds."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    try:
        probe(uri.rstrip("/") + "/health", HEALTH_TIMEOUT_S, auth=(user, password or "") if user else None)
    except Unreachable as e:
        raise QevalError(
            f"tracking server {redact(uri)} does not answer /health within {HEALTH_TIMEOUT_S:g} s ({e.why}); "
            f"start it or fix MLFLOW_TRACKING_URI, or unset it to use the local store"
        ) from None


def store_error(uri: str, e: Exception) -> str:
    """One line for an exception from the store: what went wrong and the fix, no credentials.

    SQLAlchemy puts its autoflush advice first and SQLite's own reason after it; the reason is what a
    user needs."""
    text = scrub(str(e))
    unwritable = ("readonly database", "read-only file system", "disk I/O error", "database or disk is full")
    if found := next((u for u in unwritable if u.lower() in text.lower()), None):
        return (
            f"the MLflow store {redact(uri)} cannot be written ({found}: a read-only, full or immutable file); "
            f"make it writable, or set MLFLOW_TRACKING_URI or QEVAL_WORKDIR to a writable place"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = next((line for line in lines if "Error)" in line or "Error:" in line), lines[0] if lines else "")
    return f"the MLflow store {redact(uri)} failed: {type(e).__name__}: {reason[:300]}"


def sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


# MLflow 3's server starts, beside four web workers, a job runner and seven Huey consumers for MLflow's own
# jobs (GenAI scorers, trace roll-ups), each a Python process importing mlflow. qeval submits no job and one
# reader browses its UI: one worker, no job runner (docs/toolchain.md, "MLflow").
UI_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def ui_command(host: str, port: int | str) -> list[str]:
    """The command that serves the MLflow UI over the store (with UI_ENV in its environment)."""
    uri = tracking_uri()
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    server = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--workers", "1"]
    return [*server, "--host", host, "--port", str(port)]


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Serialise store creation and experiment/run creation between processes sharing a SQLite store.

    Twelve processes creating a fresh MLflow database at once all failed (docs/toolchain.md).
    """
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    with locked(db.parent / ".qeval.lock", "the MLflow store"):
        yield


def check_artifact_root(uri: str, location: str) -> None:
    """A SQLite store keeps its artifacts' absolute place; a copied work folder's store still names the
    original's, and writing through it would change the original. Refused in one line with the fix."""
    db = sqlite_path(uri)
    place = location.removeprefix("file://") if location else ""
    if db is None or not place.startswith("/"):
        return
    root = db.parent.resolve()
    if not Path(place).resolve().is_relative_to(root):
        raise QevalError(
            f"the MLflow store {db} keeps its artifacts in {Path(place).parent}, outside {root}: it was copied from "
            f"another work folder, and writing through it would change that one; use the original folder, or move "
            f"{root} aside here to start a fresh store (finished stages are logged to it again)"
        )
