"""Shared fixtures, and the tiers (docs/architecture.md, "Processes, caching and tests").

Tiers: a test with no mark is a unit test: no process, no MLflow store, no model (`make test-fast` runs these,
in under 30 s; the fixture below refuses a process or a store to them). `integration` marks tests that start a
process or open a store (seconds each); `slow` marks those that run a model, a harness or a server (minutes).

Every test writes its artifacts and MLflow store under a temporary folder of its own, the store started as a
copy of an empty one MLflow made once (tests/helpers.py, seed_store). The small card
`ref-small` (ref-lm with tiny calibration, a 6-document limit and a small grid) is quantized, evaluated and
benchmarked once per session, in a folder the session fixtures alone write to. A test that runs more
stages, the gate or the report on those builds takes `own_root`: a copy of that folder (checkpoints
hard-linked) that nothing else reads. `qeval run` itself runs once per session, in another copy
(`pipeline_run`): every test that only reads what a whole run leaves (its stages, served builds, store,
report, ship card) reads that one. That run is a process of its own, started as soon as the session's builds
are measured, and runs beside the other tests, which are ordered before its readers (tests/lanes.py); so
do, from the session's start, tests/test_shape.py's run of a card without weights, the team test and the
side jobs (tests/lanes.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import lanes
import pytest
from helpers import REPO, empty_store_in, last_json_line, root_env, seed_store
from memory_tracker import MemoryTracker

from pipelines.core.card.cards import load_card
from pipelines.core.system import progress
from pipelines.stages.engines import torch_onednn_off
from quant.execution import CPU

TIERS = ("integration", "slow")


@pytest.fixture(scope="session", autouse=True)
def _code_version_once() -> None:
    """The git commit the stages record is asked of git once per process (code_version() keeps it), here,
    before any unit test runs: a unit test starts no process of its own."""
    from pipelines.core.framework.code import code_version

    code_version()


@pytest.fixture(autouse=True)
def _unit_tier_starts_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test (no tier mark) that starts a process or opens an MLflow store fails, naming the mark."""
    if any(request.node.get_closest_marker(t) for t in TIERS):
        return

    def refuse(what: str, original):
        def refused(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():  # a lane's (tests/lanes.py, Work)
                return original(*args, **kwargs)
            raise AssertionError(f"a unit test {what}: mark it @pytest.mark.integration (or slow)")

        return refused

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("started a process", subprocess.Popen.__init__))
    from pipelines.tracking import mlflow_tracker

    tracker = mlflow_tracker.MlflowTracker
    monkeypatch.setattr(tracker, "__init__", refuse("opened an MLflow store", tracker.__init__))


@pytest.fixture(autouse=True)
def _fresh_progress():
    """qeval's progress state (estimates from earlier builds) is per process; each test starts without it."""
    progress.reset()
    yield
    progress.reset()


@pytest.fixture
def workdir(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """QEVAL_WORKDIR in a temporary folder, and the default (SQLite) MLflow store inside it: seeded for a test
    that may open it (helpers.seed_store), but one marked `new_store`."""
    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if any(request.node.get_closest_marker(t) for t in TIERS) and not request.node.get_closest_marker("new_store"):
        seed_store(tmp_path)
    return tmp_path


@pytest.fixture
def cards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A private cards folder seeded with the shipped ref-lm card; returns a writer of new cards."""
    folder = tmp_path / "cards"
    folder.mkdir()
    shutil.copy(REPO / "pipelines/models/ref-lm.yaml", folder / "ref-lm.yaml")
    monkeypatch.setenv("QEVAL_CARDS_DIR", str(folder))

    def write(name: str, text: str) -> Path:
        path = folder / f"{name}.yaml"
        path.write_text(text)
        return path

    return write


SMALL = {
    "num_samples: 60": "num_samples: 4",
    "max_seq_length: 512": "max_seq_length: 64",
    "batch_sizes: [1, 4]": "batch_sizes: [1, 2]",
    "input_lengths: [128]": "input_lengths: [32]",
    "output_lengths: [32]": "output_lengths: [8]",
    "repeats: 5": "repeats: 3",
    "  batch_size: 32\n": "  batch_size: 32\n  limit: 6\n",
    # six documents never decide a confidence sequence: the tests that score in rounds set it themselves
    # (tests/test_rounds.py, tests/test_gate.py)
    "  stop_scoring: fail\n": "  stop_scoring: never\n",
    "concurrency: [1, 4, 16]": "concurrency: [1, 2]",
    "server:\n  requests_per_user: 3\n": "server:\n  requests_per_user: 2\n  warmup: 1\n",
    # most tests gate builds they have not served; tests/test_pipeline.py serves them and puts it back
    "  speed_regime: server\n": "  speed_regime: engine\n",
    # the search's ranking reads 4 calibration samples, not 16: its ~50 passes run one forward per sample
    "  samples: 16\n": "  samples: 4\n",
}


def use_root(mp: pytest.MonkeyPatch, root: Path) -> None:
    mp.setenv("QEVAL_WORKDIR", str(root))
    mp.setenv("QEVAL_CARDS_DIR", str(root / "cards"))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)


def small_card_text() -> str:
    """ref-lm's card as `ref-small`."""
    text = (REPO / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", "name: ref-small")
    for a, b in SMALL.items():
        assert a in text, f"ref-lm.yaml no longer has {a!r}: update tests/conftest.py SMALL"
        text = text.replace(a, b)
    return text


@pytest.fixture(scope="session")
def small_root(tmp_path_factory) -> Path:
    """A work folder with card `ref-small`: ref-lm with a tiny calibration set, limit and grid."""
    root = tmp_path_factory.mktemp("small")
    (root / "cards").mkdir()
    (root / "cards" / "ref-small.yaml").write_text(small_card_text())
    return root


@pytest.fixture
def small_card(small_root, monkeypatch):
    """The `ref-small` card, with QEVAL_WORKDIR and QEVAL_CARDS_DIR pointing at the session's folder."""
    use_root(monkeypatch, small_root)
    return load_card("ref-small")


@pytest.fixture(scope="session")
def builds(small_root):
    """Every precision of `ref-small` quantized for real, once per test session."""
    from pipelines.stages.quantize import quantize

    with pytest.MonkeyPatch.context() as mp:
        use_root(mp, small_root)
        card = load_card("ref-small")
        tracker = MemoryTracker(card.name)
        return {p: quantize(card, p, tracker) for p in card.precisions}


@pytest.fixture(scope="session")
def measured(request, small_root, builds, tmp_path_factory):
    """Every build of `ref-small` evaluated, benchmarked and sized (the gate reads each), once per test session;
    then the lanes the session's tests read are started: the heavy work of its start is done."""
    from pipelines.stages.bench import bench
    from pipelines.stages.evaluate import evaluate
    from pipelines.stages.size import size

    with pytest.MonkeyPatch.context() as mp:
        use_root(mp, small_root)
        card = load_card("ref-small")
        tracker = MemoryTracker(card.name)
        order = [card.gate.baseline, *(p for p in card.precisions if p != card.gate.baseline)]
        done = {stage.__name__: {p: stage(card, p, tracker) for p in order} for stage in (evaluate, bench, size)}
    lanes.start_read(request, tmp_path_factory, pipeline_run=lambda folder: _start_pipeline(small_root, folder))
    # the side jobs on these builds wait for the pipeline run's end, where the session runs it: its sweeps judge
    # how each server streams, and a third heavy process beside the tests' line and the run starves the server
    # enough that a request's tokens come in one burst
    lanes.ready_after("builds", small_root, request.config.stash.get(lanes.STARTED, {}).get("pipeline_run"))
    return done


def copy_root(src: Path, root: Path) -> Path:
    """A copy of work folder `src` at `root`: its cards and artifacts (files hard-linked), and an empty MLflow
    store (helpers.seed_store), not `src`'s."""
    shutil.copytree(src / "cards", root / "cards")
    shutil.copytree(
        src / "artifacts", root / "artifacts", copy_function=os.link, ignore=shutil.ignore_patterns(".lock")
    )
    return seed_store(root)


@pytest.fixture
def own_root(small_root, builds, measured, tmp_path, monkeypatch) -> Path:
    """A private copy of the session's folder (checkpoints hard-linked, an empty MLflow store), made current."""
    root = copy_root(small_root, tmp_path / "own")
    use_root(monkeypatch, root)
    return root


ALL = ("bf16", "fp8", "int8", "awq", "gptq", "int8+kv-fp8")  # ref-lm's builds, in its card's order
# the session's pipeline run's builds: fp8 only where its server runs a path of qeval's own (_start_pipeline)
SERVED = tuple(p for p in ALL if p != "awq" and (p != "fp8" or torch_onednn_off("fp8", CPU)))


@dataclass(frozen=True)
class PipelineRun:
    root: Path  # its work folder: cards, artifacts, and the MLflow store every stage logged to
    returncode: int
    doc: dict  # the JSON document `qeval run --json` printed last
    stderr: str


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The lanes' readers after the others, so that the tests before them run while the lanes do (tests/lanes.py),
    and of those, the readers of a side job that waits for the builds or a lane's end last, since it ends last;
    the `quiet` tests after all, when every lane has ended: a latency they judge against a fixed objective is not
    to be the lanes' on a shared core."""

    def when(item: pytest.Item) -> tuple[bool, bool, bool]:
        return item.get_closest_marker("quiet") is not None, lanes.reads(item), lanes.reads_waiting(item)

    items.sort(key=when)  # stable


@pytest.fixture(scope="session", autouse=True)
def _lanes(request, tmp_path_factory):
    """The lanes that need nothing of the session's and the side jobs, started as the session starts (those a
    test of it reads), after naming the folder of the session's empty store (helpers.seed_store); every lane
    started in the session, stopped as it ends."""
    empty_store_in(tmp_path_factory.mktemp("empty_store"))
    lanes.start_read(request, tmp_path_factory, **lanes.AT_START, **lanes.SIDE_JOBS)
    yield
    lanes.closing()  # a side job still waiting ends
    for lane in request.config.stash.get(lanes.STARTED, {}).values():
        lane.stop()
    lanes.beside(False)


def _start_pipeline(small_root: Path, folder: Path) -> lanes.Lane:
    """`qeval run --model ref-small` as `make run` runs it, in a copy of the session's folder: each build it
    lists served (as ref-lm's card says) and scored through its server, the gate and the report."""
    root = copy_root(small_root, folder)
    card = root / "cards" / "ref-small.yaml"
    text = card.read_text().replace("speed_regime: engine", "speed_regime: server")  # as ref-lm's
    # every build but awq and, on most CPUs, fp8, servers fewer: their other stages are the session's (`builds`,
    # `measured`), and serving them runs no path of qeval's the others do not: vLLM serves awq with gptq's one
    # kernel (CPUWNA16LinearKernel), and fp8 through the serve stage's code int8 takes, its kernel's label read
    # from vLLM's log as tests/test_engines.py reads it; but on a CPU with AMX-INT8, where fp8's server runs
    # with torch's oneDNN off (engines.torch_onednn_off), and only its server proves that works
    listed = f"precisions: [{', '.join(ALL)}]"
    assert listed in text, f"ref-lm.yaml no longer has {listed!r}: update tests/conftest.py ALL"
    text = text.replace(listed, f"precisions: [{', '.join(SERVED)}]")
    card.write_text(text)
    return lanes.start(root, root_env(root), "run", "--model", "ref-small", "--json", timeout_s=1500)


@pytest.fixture(scope="session")
def pipeline_run(request, tmp_path_factory, measured) -> PipelineRun:
    """The session's `qeval run` (started when `measured` was done), once it has ended. The tests that take it
    read what it left; none writes there, but the one that runs it again."""
    root, done = lanes.ended(request, tmp_path_factory, "pipeline_run")
    assert done.returncode in (0, 1) and done.stdout.strip(), done.stderr[-2000:]
    return PipelineRun(root, done.returncode, last_json_line(done.stdout), done.stderr)


@pytest.fixture
def pipeline_root(pipeline_run, monkeypatch) -> Path:
    """The session's pipeline run's folder, made current (for reading its store and files)."""
    use_root(monkeypatch, pipeline_run.root)
    return pipeline_run.root
