"""Where qeval reads and writes.

Outputs (artifacts/, mlruns/, reports/) go under the repository root, or under $QEVAL_WORKDIR when it is
set (tests and parallel checkouts use that to keep their stores apart). Model cards are read from
pipelines/models/, or from $QEVAL_CARDS_DIR. What lies under artifacts/ is pipelines/core/store/layout.py's.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]  # this file is pipelines/core/system/paths.py


def cards_dir() -> Path:
    """Model cards: pipelines/models/, or $QEVAL_CARDS_DIR for cards kept elsewhere."""
    return Path(os.environ.get("QEVAL_CARDS_DIR") or REPO_ROOT / "pipelines" / "models").resolve()


def workdir() -> Path:
    return Path(os.environ.get("QEVAL_WORKDIR") or REPO_ROOT).resolve()


def artifacts_dir() -> Path:
    return workdir() / "artifacts"


def mlruns_dir() -> Path:
    return workdir() / "mlruns"


def reports_dir(model: str) -> Path:
    return workdir() / "reports" / model


def resolve_repo_path(path: str) -> Path:
    """A path from a card: absolute, or relative to the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def shown_path(path: Path) -> str:
    """A path as a card names it: relative to the repository root inside it, else absolute."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path.resolve())
