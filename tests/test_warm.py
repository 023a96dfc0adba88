"""The warm Python (pipelines/core/system/warm.py): each job a fresh fork of a Python that imported its libraries
once, reporting as a fresh child does (result, one-line error, death, interrupt), nothing left behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from helpers import REPO
from warm_jobs import Job, job

from pipelines.core.system import warm
from pipelines.core.system.child import ChildFailed, run_child

pytestmark = pytest.mark.integration
ENV = {"PYTHONPATH": str(REPO / "tests")}  # the child imports warm_jobs by name, as the test does


def _run(tmp_path, action: str, name: str, **env):
    out = tmp_path / name
    return run_child(job, Job(action=action), out, tmp_path / f"{name}.log", {**ENV, **env}), out


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_jobs_fork_from_one_warm_python_and_report_as_a_fresh_child_does(tmp_path, monkeypatch):
    monkeypatch.setenv("QEVAL_WARM", "1")
    monkeypatch.setattr(warm, "driver_present", lambda: False)
    first, _ = _run(tmp_path, "ok", "a")
    second, _ = _run(tmp_path, "ok", "b")
    assert first.warmed and second.warmed  # the job's module was imported, with its WARM_IMPORTS, before the fork
    assert first.pid != second.pid and first.parent == second.parent != os.getpid()  # a fresh process each
    assert (tmp_path / "b.log").read_text() == "working on ok\n"  # its output, and nothing of the protocol's
    with pytest.raises(ChildFailed, match=r"^ValueError: no such thing$"):
        _run(tmp_path, "raise", "c")
    assert "Traceback" in (tmp_path / "c.log").read_text()
    with pytest.raises(ChildFailed, match="exited with status -9"):
        _run(tmp_path, "die", "d")
    third, _ = _run(tmp_path, "ok", "e")
    assert third.parent == first.parent  # a job that died takes only itself
    fourth, _ = _run(tmp_path, "ok", "f", QEVAL_TEST_OTHER="1")
    assert fourth.parent != first.parent and _gone(first.parent)  # another environment: another warm Python
    monkeypatch.setenv("QEVAL_WARM", "0")
    cold, _ = _run(tmp_path, "ok", "g")
    assert not cold.warmed and cold.parent == os.getpid()


def test_an_interrupt_stops_the_job_and_its_warm_python(tmp_path, monkeypatch):
    monkeypatch.setenv("QEVAL_WARM", "1")
    monkeypatch.setattr(warm, "driver_present", lambda: False)

    class Stop(Exception):
        pass

    def on_signal(signum, frame):
        raise Stop

    out = tmp_path / "h"
    previous = signal.signal(signal.SIGUSR1, on_signal)
    pid_file = out / "pid"
    poke = threading.Thread(target=lambda: (_wait_for(pid_file), os.kill(os.getpid(), signal.SIGUSR1)))
    poke.start()
    try:
        with pytest.raises(Stop):
            run_child(job, Job(action="hang"), out, tmp_path / "h.log", ENV)
    finally:
        poke.join()
        signal.signal(signal.SIGUSR1, previous)
    assert _gone(int(pid_file.read_text()))
    assert "warm_jobs" not in warm._warm and not warm._lock.locked()  # forgotten; the next job starts another


def _wait_for(path) -> None:
    """Until the job has written its pid (the file exists, empty, between its creation and the write)."""
    deadline = time.monotonic() + 60
    while not (path.is_file() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
