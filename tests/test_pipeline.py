"""`qeval run` as `make run` uses it: every stage for every build, then a rerun that skips them all."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import REPO, env_with, last_json_line

pytestmark = pytest.mark.slow


def test_run_does_every_stage_then_skips_them(small_root, builds):
    env = env_with(QEVAL_WORKDIR=str(small_root), QEVAL_CARDS_DIR=str(small_root / "cards"))
    cmd = [sys.executable, "-m", "pipelines", "run", "--model", "ref-small", "--json"]
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    stages = last_json_line(first.stdout)["stages"]
    precisions = ["bf16", "fp8", "int8", "awq", "gptq"]
    assert [(s["stage"], s["precision"]) for s in stages] == [
        (stage, p) for stage in ("quantize", "evaluate", "bench") for p in precisions
    ]
    assert {s["status"] for s in stages if s["stage"] == "quantize"} == {"skipped"}  # built by the fixture
    t0 = time.perf_counter()
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and time.perf_counter() - t0 < 60
    assert {s["status"] for s in last_json_line(again.stdout)["stages"]} == {"skipped"}
