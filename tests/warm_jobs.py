"""Jobs for tests/test_warm.py: what a child runs (pipelines/core/system/child.py), light enough to start in a blink."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from pydantic import BaseModel

WARM_IMPORTS = ("wave",)  # a module no fresh child of this file imports: its presence shows a warm start


class Job(BaseModel):
    action: str


class Done(BaseModel):
    pid: int
    parent: int
    warmed: bool


def job(cfg: Job, out: Path) -> Done:
    warmed = "wave" in sys.modules
    (out / "pid").write_text(str(os.getpid()))
    print(f"working on {cfg.action}", flush=True)
    if cfg.action == "raise":
        raise ValueError("no such thing")
    if cfg.action == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg.action == "hang":
        time.sleep(120)
    return Done(pid=os.getpid(), parent=os.getppid(), warmed=warmed)
