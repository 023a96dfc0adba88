"""`qeval ui` starts a real MLflow server on loopback over the store and stops it on Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from helpers import REPO, env_with, free_port

from pipelines.tracking.mlflow_tracker import MlflowTracker

pytestmark = pytest.mark.slow


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_ui_serves_the_store_on_loopback_and_stops(workdir, stop):
    MlflowTracker("ref-lm").build_run("bf16")
    port = free_port()
    # to a file, not a pipe nobody reads while it runs: once the server's output fills a pipe, its
    # shutdown (and the interpreter's final flush) blocks on writing
    log = workdir / "ui.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines", "ui", "--port", str(port)],
            cwd=REPO,
            env=env_with(QEVAL_WORKDIR=str(workdir)),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                status, _ = _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert proc.poll() is None, log.read_text()
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
        proc.send_signal(stop)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-2000:]
    time.sleep(1)
    with pytest.raises(OSError):
        _get(f"http://127.0.0.1:{port}/health")
    store = str(workdir)  # the MLflow server and uvicorn name the store in their command lines
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if store in " ".join(p.info["cmdline"] or [])]
    assert left == []
