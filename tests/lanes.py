"""Work that runs beside the tests: a `qeval` process (a Lane) or a thread that waits on processes of its own (a
Work: the team test's servers, commands and checks; a side job), in a folder of its own, and read by the tests
that take its fixture, which tests/conftest.py orders after all the others. The session's pipeline run starts
once the session's builds are measured; the others, which need nothing of the session's, and the side jobs at
its start.

A side job (`side_job`) is a test's own processes (a `qeval` command that must fail one way, a server it drives)
taken off the test process's line: the side jobs run one after another in threads of their own, so that the
tests' line and theirs keep both cores busy where the test process would have waited on each in turn; two at
once when the test process has nothing left but to wait for them.

Most of such a run is one core's work (vLLM's start-up imports, one process after another; a sweep's client),
so on two cores it costs the session little more than the wait, if any, for what is left of it when its
readers come. None of them judges a speed against a fixed figure: a busy machine makes a level slower or
too close to call, and the readers accept any of the three verdicts.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, qeval_command


@dataclass
class Lane:
    """`qeval ARGS` going on in a process of its own; its output in `root`/run.stdout and run.stderr."""

    root: Path
    proc: subprocess.Popen
    started: float
    timeout_s: float

    def wait(self) -> subprocess.CompletedProcess:
        """Its end, as `subprocess.run` would have returned it; a run past its time is stopped and fails the test."""
        left = self.started + self.timeout_s - time.monotonic()
        try:
            self.proc.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{' '.join(self.proc.args[2:])} took over {self.timeout_s:.0f} s", pytrace=False)
        out, err = ((self.root / name).read_text() for name in ("run.stdout", "run.stderr"))
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Ended, whatever the session did: SIGTERM stops `qeval` and any server it started."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Work:
    """`work()` going on in a thread of this process, for work that is processes of its own (servers, `qeval`
    commands) and their checks: the thread waits on them, as a Lane's process would."""

    def __init__(self, root: Path, work: Callable[[], object], timeout_s: float) -> None:
        self.root, self.timeout_s, self.started = root, timeout_s, time.monotonic()
        self.outcome: tuple[object, BaseException | None] | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), name=root.name, daemon=True)
        self.thread.start()

    def _run(self, work: Callable[[], object]) -> None:
        try:
            self.outcome = (work(), None)
        except BaseException as e:  # a failed check (pytest.fail included) fails the test that reads the lane
            self.outcome = (None, e)

    def running(self) -> bool:
        return self.thread.is_alive()

    def wait(self) -> object:
        """What `work()` returned, once it has; what it raised is raised here."""
        self.thread.join(max(self.started + self.timeout_s - time.monotonic(), 1))
        if self.outcome is None:
            pytest.fail(f"{self.root.name} took over {self.timeout_s:.0f} s", pytrace=False)
        value, error = self.outcome
        if error is not None:
            raise error
        return value

    def stop(self) -> None:
        """Its work bounds each of its processes' time and stops them itself: this waits for that."""
        self.thread.join(self.timeout_s)


# side jobs that may run at once: one while the test process works beside them, two once it only waits for them
# (`waiting_only`); and how many run
_slots = {"allowed": 1, "running": 0}
_ready: dict[str, Path] = {}  # what a side job may wait for, once it is there: "builds", or a lane that has ended
_closing: list[bool] = []  # [True] once the session ends: nothing more comes
_changed = threading.Condition()


def ready(what: str, root: Path) -> None:
    """`what` is there, in `root`: the session's builds ("builds", tests/conftest.py `measured`), or a lane's end
    (its name)."""
    with _changed:
        _ready[what] = root
        _changed.notify_all()


def closing() -> None:
    """The session ends: a side job still waiting for what has not come fails."""
    with _changed:
        _closing[:] = [True]
        _changed.notify_all()


def waiting_only() -> None:
    """The test process only waits for the side jobs from now on: two may run at once."""
    with _changed:
        _slots["allowed"] = 2
        _changed.notify_all()


@contextmanager
def _slot() -> Iterator[None]:
    """A side job's turn: held while it runs."""
    with _changed:
        _changed.wait_for(lambda: _slots["running"] < _slots["allowed"])
        _slots["running"] += 1
    try:
        yield
    finally:
        with _changed:
            _slots["running"] -= 1
            _changed.notify_all()


def ready_after(what: str, root: Path, lane: Lane | Work | None) -> None:
    """`what` is there, in `root`, once `lane` has ended (at once where there is no lane), from a thread of its
    own."""
    if lane is None:
        ready(what, root)
        return

    def watch() -> None:
        if isinstance(lane, Lane):
            lane.proc.wait()
        else:
            lane.thread.join()
        ready(what, root)

    threading.Thread(target=watch, name=f"{what} after {lane.root.name}", daemon=True).start()


def side_job(name: str, job: Callable[..., object], timeout_s: float = 900, *, after: str | None = None):
    """`job(folder, env)` run beside the tests from the session's start, after the side jobs before it, with the
    environment of the session's start (`env`, not what a test's monkeypatch sets meanwhile); with `after`,
    `job(folder, env, root)` once that is there: the session's builds, measured, and the session's pipeline run
    ended ("builds", in the session's folder; its readers take `measured`), or a lane's end (its name and
    fixture; its folder). Returns the fixture `name`, which waits for it and gives what it returned (raising
    what it raised); its test module assigns it to a name of its own for pytest to find."""

    def begin(folder: Path) -> Work:
        beside(True)
        env = dict(os.environ)

        def one() -> object:
            more = ()
            if after is not None:
                with _changed:
                    _changed.wait_for(lambda: after in _ready or _closing, timeout_s)
                if after not in _ready:
                    raise RuntimeError(f"{name}: {after} never came")
                more = (_ready[after],)
            with _slot():
                return job(folder, env, *more)

        return Work(folder, one, timeout_s)

    SIDE_JOBS[name] = begin
    if after is not None:
        WAITING.add(name)

    def waited(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
        if after is not None:  # what the job waits for, made here where it runs alone
            request.getfixturevalue("measured" if after == "builds" else after)
            # the waiting side jobs' readers come last but for the quiet tests (tests/conftest.py): the test
            # process has nothing else to do
            waiting_only()
        return ended(request, tmp_path_factory, name)[1]

    return pytest.fixture(waited, name=name)


# Beside a lane, two processes' OpenMP teams share the two cores. Unless told otherwise, libgomp's threads spin
# while they wait at a barrier, so each team's spinning holds the core the other team's next thread needs, and
# both crawl; with passive waiting neither does (docs/results.md, "Two OpenMP teams on two cores"). Passive
# waiting slows a process that runs alone, so it holds only while lanes run: in each lane's environment, and in
# the children the tests start meanwhile; the test process itself (whose OpenMP runtime read its settings at its
# start) computes on one thread meanwhile. Neither changes a stage's threads, nor so its cache key or numbers.
BESIDE = {"OMP_WAIT_POLICY": "PASSIVE"}
_before: dict[str, str | None] = {}


def start(root: Path, env: dict[str, str], *args: str, timeout_s: float) -> Lane:
    """`qeval ARGS` started from the repository with `env` (and BESIDE), its output kept in `root`."""
    with open(root / "run.stdout", "w") as out, open(root / "run.stderr", "w") as err:
        proc = subprocess.Popen(qeval_command(*args), cwd=REPO, env={**env, **BESIDE}, stdout=out, stderr=err)
    return Lane(root, proc, time.monotonic(), timeout_s)


def work(root: Path, what: Callable[[], object], timeout_s: float) -> Work:
    """`what()` started in a thread, with this session's settings beside lanes (BESIDE) already in the
    environment its processes inherit."""
    beside(True)
    return Work(root, what, timeout_s)


def beside(on: bool) -> None:
    """This session's settings while lanes run (on), or as they were before (off)."""
    import torch

    if on and not _before:
        _before.update({name: os.environ.get(name) for name in BESIDE}, threads=str(torch.get_num_threads()))
        os.environ.update(BESIDE)
        torch.set_num_threads(1)
    elif not on and _before:
        torch.set_num_threads(int(_before.pop("threads")))
        for name, value in _before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _before.clear()


# fixture name -> how to start its lane in a folder of its own, where it needs nothing of the session's (a test
# module adds its own); tests/conftest.py starts those the session reads, and the side jobs, as it starts (a side
# job that needs the session's builds or a lane's end waits for it)
AT_START: dict[str, Callable[[Path], Lane | Work]] = {}
SIDE_JOBS: dict[str, Callable[[Path], Work]] = {}
WAITING: set[str] = set()  # the side jobs that wait for the builds or a lane's end: they end last
# the lanes started, by fixture name (tests/conftest.py stops each as the session ends)
STARTED = pytest.StashKey[dict[str, Lane | Work]]()


def names() -> tuple[str, ...]:
    return ("pipeline_run", *AT_START, *SIDE_JOBS)


def reads(item: pytest.Item, name: str | None = None) -> bool:
    """Whether the test takes the fixture of lane `name` (any lane's where None)."""
    taken = getattr(item, "fixturenames", ())
    return any(n in taken for n in ((name,) if name else names()))


def reads_waiting(item: pytest.Item) -> bool:
    """Whether the test takes the fixture of a side job that waits (WAITING), which ends after the lanes."""
    return any(reads(item, name) for name in WAITING)


def start_read(request: pytest.FixtureRequest, folders, **how: Callable[[Path], Lane | Work]) -> None:
    """Start every lane of `how` (name -> how to start it) that a test of the session reads and that has not
    started, each in a folder of `folders` (pytest's tmp_path_factory) named after it."""
    started = request.config.stash.setdefault(STARTED, {})
    for name, begin in how.items():
        if name not in started and any(reads(item, name) for item in request.session.items):
            started[name] = begin(folders.mktemp(name))
            ready_after(name, started[name].root, started[name])
    if any(lane.running() for lane in started.values()):
        beside(True)


def ended(request: pytest.FixtureRequest, folders, name: str) -> tuple[Path, object]:
    """Lane `name`'s folder and how it ended (a process's CompletedProcess, a Work's value), once it has (started
    here, where nothing started it before)."""
    started = request.config.stash.setdefault(STARTED, {})
    if name not in started:
        begin = {**AT_START, **SIDE_JOBS}[name]
        started[name] = begin(folders.mktemp(name))  # waited for at once: nothing runs beside it here
        ready_after(name, started[name].root, started[name])
    try:
        done = started[name].wait()
    finally:  # what its work raised, too, leaves the settings beside lanes to the lanes still running
        if not any(lane.running() for lane in started.values()):
            beside(False)
    return started[name].root, done
