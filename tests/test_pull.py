"""`qeval pull`'s target: never inside what qeval keeps, and what a killed pull left behind is cleaned
(issue 41: a pull into a build's own checkpoint exited 0, and the next gate found an added file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from memory_tracker import MemoryTracker

from pipelines.core.system.errors import QevalError


@pytest.mark.parametrize(
    "inside", ["artifacts/ref-small/awq/quantize/checkpoint/sub", "mlruns/x", "reports/ref-small/pulled", "cards/x"]
)
def test_pull_refuses_a_folder_inside_what_qeval_keeps_before_writing(tmp_path, monkeypatch, inside):
    from pipelines.tracking.readback import pull

    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path))
    monkeypatch.setenv("QEVAL_CARDS_DIR", str(tmp_path / "cards"))
    kept = inside.split("/")[0]
    with pytest.raises(QevalError, match=rf"is inside .*/{kept}, which qeval keeps .*; name a folder outside it"):
        pull(MemoryTracker("ref-small"), "ship", tmp_path / inside)
    assert not (tmp_path / inside).exists()


def test_a_scratch_folder_left_by_a_killed_process_goes_and_a_live_ones_stays(tmp_path):
    from pipelines.core.system.files import scratch

    target = tmp_path / "deploy"
    never = int(Path("/proc/sys/kernel/pid_max").read_text())  # the kernel hands out pids below it
    dead, live = tmp_path / f".deploy.pull-{never}", tmp_path / f".deploy.pull-{os.getppid()}"
    for left in (dead, live):
        (left / "checkpoint").mkdir(parents=True)
    with scratch(target, "pull") as mine:
        assert mine.is_dir() and not dead.exists() and live.is_dir()
    assert not mine.exists() and live.is_dir()
