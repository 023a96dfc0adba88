"""Run a server so that it cannot outlive the qeval process that started it.

`python watchdog.py <owner pid> -- <command...>`, started as its own process group's leader (procs.py's
running()): it starts the command in its group and waits for it. When the owner dies in any way, SIGKILL
included (an OOM killer, a CI hard timeout), or when the group is sent SIGTERM, it stops the whole group:
SIGTERM, then SIGKILL after GRACE_S. Standard library only, so that it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

GRACE_S = 5.0  # what a server gets to shut down cleanly before the group is killed
POLL_S = 0.2


def _stop_group(child: subprocess.Popen) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the server; this one stays to finish
    try:
        os.killpg(os.getpgrp(), signal.SIGTERM)
        child.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # this process too
    return child.returncode if child.returncode is not None else 143


def main(argv: list[str]) -> int:
    owner, sep, cmd = int(argv[0]), argv[1], argv[2:]
    if sep != "--" or not cmd:
        print("usage: watchdog.py <owner pid> -- <command...>", file=sys.stderr)
        return 2
    stopping = False

    def on_term(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    child = subprocess.Popen(cmd)
    while True:
        try:
            code = child.wait(POLL_S)
            return code
        except subprocess.TimeoutExpired:
            pass
        if stopping or os.getppid() != owner:  # asked to stop, or the owner is gone (we were re-parented)
            return _stop_group(child)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
