"""Child processes that own a process group (servers, UIs): start them on a free loopback port, wait
until they are healthy, and stop them and everything they started on every way out."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.core.system.errors import QevalError
from pipelines.core.system.net import answers
from pipelines.core.system.nvidia import memory_back_after

WATCHDOG = Path(__file__).with_name("watchdog.py")


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
def running(
    cmd: list[str],
    log_path: Path,
    timeout: float,
    what: str,
    env: dict | None = None,
    nice: int = 0,
    *,
    on_gpu: bool = False,
) -> Iterator[str]:
    """Start a server on a free loopback port (`{port}` in cmd), wait for /health, always stop its group.

    Yields the server's base URL; a server that exits or stays unhealthy is one error naming its log. The
    server runs under watchdog.py, which stops its group should this process be killed (SIGKILL included),
    and with `nice`, runs it that many steps below normal priority. `on_gpu`: once stopped after a run that ended well,
    the GPU's memory is waited for until it is back to what it was before the server started (nvidia.py), so that
    the next one can start beside nothing.
    """
    with memory_back_after(what, on_gpu), _serving(cmd, log_path, timeout, what, env, nice) as url:
        yield url


@contextmanager
def _serving(cmd: list[str], log_path: Path, timeout: float, what: str, env: dict | None, nice: int) -> Iterator[str]:
    port = free_port()
    # under a watchdog that stops the server's group when this process dies, however it dies
    lower = ["--nice", str(nice)] if nice else []
    cmd = [
        sys.executable,
        str(WATCHDOG),
        str(os.getpid()),
        *lower,
        "--",
        *(c.replace("{port}", str(port)) for c in cmd),
    ]
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, log_path, what)
        yield url
    finally:
        if proc.poll() is None:  # what the server writes from here on is its shutdown, not a fault
            with log_path.open("a") as log:
                log.write(
                    f"\n---- qeval stops {what} now (SIGTERM); what follows is its shutdown: a traceback such as "
                    f"vLLM's EngineDeadError below is how it ends, not a failure ----\n"
                )
        stop_process_group(proc)
