"""Shared fixtures: every test writes its artifacts and MLflow store under its own temporary folder."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """QEVAL_WORKDIR in a temporary folder, and the default (SQLite) MLflow store inside it."""
    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


@pytest.fixture
def cards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A private cards folder seeded with the shipped ref-lm card; returns a writer of new cards."""
    folder = tmp_path / "cards"
    folder.mkdir()
    shutil.copy(REPO / "pipelines/models/ref-lm.yaml", folder / "ref-lm.yaml")
    monkeypatch.setenv("QEVAL_CARDS_DIR", str(folder))

    def write(name: str, text: str) -> Path:
        path = folder / f"{name}.yaml"
        path.write_text(text)
        return path

    return write


def last_json_line(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(extra)
    return env
