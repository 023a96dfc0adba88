"""Run a server so that it cannot outlive the qeval process that started it.

`python watchdog.py <owner pid> [--nice N] -- <command...>`, started as its own process group's leader (procs.py's
running()): it starts the command in its group and waits for it. When the owner dies in any way, SIGKILL
included (an OOM killer, a CI hard timeout), or when the group is sent SIGTERM, it stops the whole group:
SIGTERM, then SIGKILL after GRACE_S. Standard library only, so that it starts in milliseconds.

With `--nice N` the server and everything it starts run N steps below normal priority: this process's nice value
(inherited) and, where the kernel groups a session's processes for scheduling (autogroup: the server leads a
session of its own, and nice values count only within a group), its session's group
(`/proc/self/autogroup`, sched(7)). Raising a nice value needs no privilege; where either cannot be set, the
server runs at normal priority and its log says so.
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


def lower_priority(nice: int) -> str:
    """This process (and what it starts) `nice` steps lower, and its session's scheduling group where the
    kernel has one; what was set, in words."""
    said = []
    try:
        os.nice(nice)
        said.append(f"nice {nice}")
    except OSError as e:
        said.append(f"nice not set ({e.strerror})")
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
        said.append(f"its session's scheduling group at nice {nice}")
    except OSError as e:
        if os.path.exists("/proc/self/autogroup"):
            said.append(f"its session's scheduling group not set ({e.strerror})")
    return ", ".join(said)


def main(argv: list[str]) -> int:
    owner, nice = int(argv[0]), 0
    if argv[1:2] == ["--nice"]:
        nice, argv = int(argv[2]), [argv[0], *argv[3:]]
    sep, cmd = argv[1], argv[2:]
    if sep != "--" or not cmd:
        print("usage: watchdog.py <owner pid> [--nice N] -- <command...>", file=sys.stderr)
        return 2
    if nice:
        print(f"qeval: the server runs below normal priority: {lower_priority(nice)}", file=sys.stderr, flush=True)
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
