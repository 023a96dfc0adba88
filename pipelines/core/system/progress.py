"""qeval's own progress on long work: every so often one line with the build, the stage, what the work is
doing, the time it has taken and an estimate of the rest.

Third-party output (progress bars, warnings) goes to the stage's log file, not the console
(pipelines/core/system/child.py); the latest line of it is what `step` reports here, shortened. The state is this
process's (the running step, the seconds of the builds done); reset() clears it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pipelines.core.system.errors import QevalError

log = logging.getLogger(__name__)


def every_s() -> float:
    """Seconds between progress lines: $QEVAL_PROGRESS_S, else 30; QevalError for anything but a number of seconds
    from 1 (more often floods the log) to a day (less often, or infinity, is no progress at all)."""
    text = os.environ.get("QEVAL_PROGRESS_S") or "30"
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1 <= value <= 86_400:
        raise QevalError("QEVAL_PROGRESS_S is not a number of seconds from 1 to 86400 (a day); unset it for 30")
    return value


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_state = {"step": ""}
_taken: dict[tuple[str, str], list[float]] = {}  # (model, stage) -> seconds of the builds done in this process


def reset() -> None:
    """Forget the running step and the builds done (a new run in the same process, or a test)."""
    _state["step"] = ""
    _taken.clear()


def step(text: str) -> None:
    """What the running work is doing now, in a few words (a progress bar's latest state, a level)."""
    _state["step"] = " ".join(_ANSI.sub("", text).split())[:90]


TAIL_CHARS = 4096  # of a line not ended yet, kept for the next chunk


def last_line(text: str) -> tuple[str | None, str]:
    """The latest whole non-empty line of output that goes on (progress bars redraw with carriage returns),
    and what follows it, not ended yet: a pipe's chunk can end mid-line, and its fragment is no step."""
    *ended, rest = re.split(r"[\r\n]", text)
    parts = [p for p in ended if p.strip()]
    return (parts[-1] if parts else None), rest[-TAIL_CHARS:]


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def estimate(model: str, stage: str, earlier: float | None) -> float | None:
    """How long the stage should take: its last run for this build, else the mean of this stage's other
    builds done in this process (same model, same settings)."""
    if earlier is not None:
        return earlier
    done = _taken.get((model, stage))
    return sum(done) / len(done) if done else None


def finished(model: str, stage: str, seconds: float) -> None:
    _taken.setdefault((model, stage), []).append(seconds)


def line(label: str, elapsed: float, expected: float | None, doing: str) -> str:
    if expected is None:
        left = ""
    elif elapsed < expected:
        left = f", about {duration(expected - elapsed)} left"
    else:
        left = f", past the {duration(expected)} estimate"
    return f"{label}: {duration(elapsed)}{left}" + (f"; {doing}" if doing else "")


@contextmanager
def heartbeat(label: str, expected: float | None, every: float | None = None) -> Iterator[None]:
    """Log a progress line every `every` seconds (default every_s()) while the block runs."""
    period = every or every_s()
    stop = threading.Event()
    t0 = time.monotonic()
    _state["step"] = ""

    def beat() -> None:
        while not stop.wait(period):
            log.info("%s", line(label, time.monotonic() - t0, expected, _state["step"]))

    thread = threading.Thread(target=beat, name="qeval-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
