"""A warm Python for the children: it imports once what a kind of job needs, then forks a fresh process per job.

    python -m pipelines.core.system.warm NONCE

reads one job a line on its stdin (a JSON list: the target `module:function`, its config file, its output
folder), runs it in a fork as pipelines/core/system/child.py runs it in a fresh process, and when the fork has
exited writes `NONCE <exit status>` on its stdout, after every byte the job wrote there. Before its first fork
it imports the target's module and the names in the module's WARM_IMPORTS (lm-eval, transformers, torch: the
seconds every child would otherwise spend importing them again). It leaves when its stdin closes.

A job still runs alone: its own process, memory and patched kernels, none left behind for the next. One warm
Python per target module and environment, so that what it imported is what a fresh child of that kind
imports, at the same settings. Not used where a GPU driver is seen (a process that has touched CUDA must not
fork, and there the imports are seconds against minutes of work), for another environment's interpreter, or
with QEVAL_WARM=0.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import secrets
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

from pipelines.core.system import job
from pipelines.core.system.device import driver_present
from pipelines.core.system.paths import REPO_ROOT
from pipelines.core.system.procs import stop_process_group


def usable(python: str | None) -> bool:
    """Jobs for `python` (None: this interpreter) may run in a warm Python here."""
    return python is None and os.environ.get("QEVAL_WARM", "1") != "0" and not driver_present()


class Warm:
    """One warm Python, started with `env`, for jobs of one target module."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.nonce = secrets.token_hex(12).encode()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.core.system.warm", self.nonce.decode()],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its forks share its group, so that an interrupt stops them together
        )
        self.code: int | None = None

    def run(self, target: str, config: Path, out: Path) -> Iterator[bytes]:
        """The job's output as it comes; then `self.code` is its exit status (None: this Python died)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.code = None
        try:
            self.proc.stdin.write((json.dumps([target, str(config), str(out)]) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return
        held = b""  # the end of what was read, where a split end line may start
        for chunk in iter(lambda: self.proc.stdout.read1(4096), b""):
            held += chunk
            if (at := held.find(self.nonce)) >= 0:
                yield held[:at]
                rest = held[at + len(self.nonce) :]
                while not rest.endswith(b"\n"):
                    more = self.proc.stdout.read1(64)
                    if not more:
                        return
                    rest += more
                self.code = int(rest.split()[0])
                return
            keep = len(self.nonce) - 1
            if len(held) > keep:
                yield held[:-keep]
                held = held[-keep:]
        yield held

    def stop(self) -> None:
        """Stop it and the job it runs (an interrupt), or let it leave (nothing runs)."""
        stop_process_group(self.proc)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


_warm: dict[str, Warm] = {}  # by target module: one each, the latest environment's
_lock = threading.Lock()


def take(module: str, env: dict[str, str]) -> Warm | None:
    """The warm Python for jobs of `module` in `env`, held until give(): kept from the last job where the
    environment is the same, else started (and one for another environment stopped). None when another
    thread holds one (that caller starts a fresh process instead)."""
    if not _lock.acquire(blocking=False):
        return None
    warm = _warm.get(module)
    if warm is not None and (warm.env != env or warm.proc.poll() is not None):
        warm.stop()
        warm = None
    if warm is None:
        warm = _warm[module] = Warm(env)
    return warm


def give(warm: Warm, *, healthy: bool) -> None:
    """Hand `warm` back after a job; one that died or was interrupted is stopped and forgotten."""
    try:
        if not healthy or warm.code is None:
            warm.stop()
            for module, value in list(_warm.items()):
                if value is warm:
                    del _warm[module]
    finally:
        _lock.release()


@atexit.register
def _close_all() -> None:
    for warm in _warm.values():
        warm.stop()
    _warm.clear()


def _serve(nonce: str) -> int:
    devnull = os.open(os.devnull, os.O_RDONLY)
    for line in sys.stdin:
        target, config, out = json.loads(line)
        try:  # what the job will import; one that fails to import fails in the fork, with its one line
            module = importlib.import_module(target.partition(":")[0])
            for name in getattr(module, "WARM_IMPORTS", ()):
                importlib.import_module(name)
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the job: stdin is not its to read
            os.dup2(devnull, 0)
            code = 1
            try:
                code = job.main([target, config, out])
            except BaseException:  # as a fresh Python would print it
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(f"{nonce} {os.waitstatus_to_exitcode(status)}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))
