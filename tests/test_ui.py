"""`qeval ui` starts a real MLflow server on loopback over the store and stops it on Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import lanes
import psutil
import pytest
from helpers import REPO, env_with, free_port, seed_store
from mlflow.tracking import MlflowClient

from pipelines.tracking.names import experiment_name
from pipelines.tracking.store import sqlite_store

pytestmark = pytest.mark.slow


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


def _ui(workdir, port: int, log, env: dict[str, str]) -> subprocess.Popen:
    """`qeval ui` on `port`, its output to a file, not a pipe nobody reads while it runs: once the server's output
    fills a pipe, its shutdown (and the interpreter's final flush) blocks on writing."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pipelines", "ui", "--port", str(port)],
            cwd=REPO,
            env=env_with(env, QEVAL_WORKDIR=str(workdir)),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _two_uis(workdir: Path, env: dict[str, str]) -> dict[str, int]:
    """Two `qeval ui` over one store, started at once (a start is mostly one core's imports): each answers on
    127.0.0.1 alone with the store's experiment; one is stopped by SIGINT (Ctrl-C), the other by SIGTERM, each
    ends with status 0, its port closed, and nothing it started is left. Beside the tests (tests/lanes.py)."""
    # qeval's store in its work folder (pipelines/tracking/store.py), with one experiment
    MlflowClient(sqlite_store(seed_store(workdir) / "mlruns")).create_experiment(experiment_name("ref-lm"))
    ports: list[int] = []
    while len(ports) < 2:
        if (port := free_port()) not in ports:
            ports.append(port)
    stops = {signal.SIGINT: ports[0], signal.SIGTERM: ports[1]}
    logs = {stop: workdir / f"ui-{stop.name}.log" for stop in stops}
    procs = {stop: _ui(workdir, port, logs[stop], env) for stop, port in stops.items()}
    try:
        for stop, port in stops.items():
            deadline = time.monotonic() + 120
            while True:
                try:
                    status, _ = _get(f"http://127.0.0.1:{port}/health")
                    break
                except OSError:
                    assert procs[stop].poll() is None, logs[stop].read_text()
                    assert time.monotonic() < deadline, "the MLflow UI did not come up within 120 s"
                    time.sleep(1)
            assert status == 200
            listening = [c for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN"]
            assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
            _, body = _get(
                f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/get-by-name?experiment_name=qeval/ref-lm"
            )
            assert '"name": "qeval/ref-lm"' in body or '"name":"qeval/ref-lm"' in body
    finally:
        for stop, proc in procs.items():
            proc.send_signal(stop)
        for proc in procs.values():
            proc.wait(30)
    for stop, proc in procs.items():
        assert proc.returncode == 0, (stop.name, logs[stop].read_text()[-2000:])
    time.sleep(1)
    for port in stops.values():
        with pytest.raises(OSError):
            _get(f"http://127.0.0.1:{port}/health")
    store = str(workdir)  # the MLflow server and uvicorn name the store in their command lines
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if store in " ".join(p.info["cmdline"] or [])]
    assert left == []
    return {stop.name: proc.returncode for stop, proc in procs.items()}


two_uis = lanes.side_job("two_uis", _two_uis)


def test_ui_serves_the_store_on_loopback_and_stops_on_ctrl_c_and_on_sigterm(two_uis):
    """What _two_uis checked beside the tests (what failed there is raised here): each ended with status 0."""
    assert two_uis == {"SIGINT": 0, "SIGTERM": 0}
