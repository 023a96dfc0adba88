"""Child processes that own a process group (servers, UIs): start them on a free loopback port, wait
until they are healthy, and stop them and everything they started on every way out."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.core.errors import QevalError
from pipelines.core.net import answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it has not ended within `timeout`."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: Path, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if answers(url, timeout=2):
            return
        if proc.poll() is not None:
            raise QevalError(f"{what} exited with status {proc.returncode} before it was healthy; see {log_path}")
        if time.monotonic() > deadline:
            raise QevalError(f"{what} did not answer {url}/health within {timeout:.0f} s; see {log_path}")
        time.sleep(0.5)


@contextmanager
def running(cmd: list[str], log_path: Path, timeout: float, what: str, env: dict | None = None) -> Iterator[str]:
    """Start a server on a free loopback port (`{port}` in cmd), wait for /health, always stop its group.

    Yields the server's base URL; a server that exits or stays unhealthy is one error naming its log.
    """
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, log_path, what)
        yield url
    finally:
        stop_process_group(proc)
