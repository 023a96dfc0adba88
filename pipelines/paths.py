"""Where qeval reads and writes, and how it writes: atomically, with content digests.

Outputs (artifacts/, mlruns/, reports/) go under the repository root, or under $QEVAL_WORKDIR when
it is set (tests and parallel checkouts use that to keep their stores apart). Model cards are read from
pipelines/models/, or from $QEVAL_CARDS_DIR. What lies under artifacts/ is pipelines/results.py's.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STAGE_LOG = "stage.log"  # in each stage's folder: qeval's lines and its children's output, the run page's log


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


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write a file whole or not at all: a temporary file beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def file_digest(paths: Iterable[Path]) -> str:
    """sha256 over files (and every file under folders), by relative name and content."""
    h = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()
