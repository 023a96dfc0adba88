"""The one logging set-up: qeval's own lines to the console, its detail and the libraries' to each stage's
log (pipelines/core/framework/runner.py adds that file while a stage runs), the libraries quieted.

Called by the command line and by a Ray worker running a build's stages (pipelines/fanout.py); nothing
is configured at import time.
"""

from __future__ import annotations

import logging
import os
import sys

OURS = ("pipelines", "eval", "quant")
QUIET = {"httpx": logging.WARNING}
"""Libraries whose INFO lines are noise here: a line per HTTP request (MLflow's: QUIET_ENVIRONMENT)."""


def setup(*, verbose: bool = False, rich_console=None) -> None:
    """Console lines at INFO (DEBUG with `verbose`): Rich's on a terminal (`rich_console`), else plain
    `HH:MM:SS message` lines for files and CI logs; qeval's own loggers pass DEBUG on to the stage logs."""
    console: logging.Handler
    if rich_console is not None and rich_console.is_terminal:
        from rich.logging import RichHandler

        console = RichHandler(console=rich_console, show_path=False, rich_tracebacks=False)
    else:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    console.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(message)s", handlers=[console], force=True
    )
    for name in OURS:
        logging.getLogger(name).setLevel(logging.DEBUG)
    for name, level in QUIET.items():
        logging.getLogger(name).setLevel(level)


QUIET_ENVIRONMENT = {
    # nothing leaves the machine unless the user says so: MLflow and the hub client both phone home by default
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # its bars are not qeval's progress
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # a "View run" line per stage logged
    # MLflow sets its own loggers' level when it is imported (mlflow/utils/logging_utils.py,
    # _configure_mlflow_loggers), from this variable: its migration chatter is not qeval's progress
    "MLFLOW_LOGGING_LEVEL": "WARNING",
}


def quiet_environment() -> None:
    """Set QUIET_ENVIRONMENT where the user has not: this process and the children it starts inherit it."""
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
