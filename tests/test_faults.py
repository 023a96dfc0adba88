"""Faults a user or a CI runner meets, with local stand-ins that behave like them: one clear line, exit
status 2 (130 when stopped), within seconds, no password printed, nothing marked done that is not and no
process left behind."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import lanes
import pytest
from helpers import REPO, card_env, env_with, free_port, processes_naming, root_env
from helpers import qeval_timed as _qeval

from conftest import copy_root
from pipelines.tracking.store import UI_ENV

pytestmark = pytest.mark.integration  # processes, servers and stores, each of its own

PASSWORD = "S3cretPW99"


def test_a_tracking_server_with_nothing_listening_fails_fast_and_keeps_its_password(tmp_path):
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{free_port()}"
    done, seconds = _qeval(
        "gate", "--model", "ref-lm", env=env_with(MLFLOW_TRACKING_URI=uri, QEVAL_WORKDIR=str(tmp_path))
    )
    assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "does not answer /health" in last and "tracking server http://127.0.0.1:" in last
    assert PASSWORD not in done.stdout + done.stderr


def test_a_tracking_server_that_never_answers_fails_within_its_timeout(tmp_path):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        done, seconds = _qeval(
            "gate", "--model", "ref-lm", env=env_with(MLFLOW_TRACKING_URI=uri, QEVAL_WORKDIR=str(tmp_path))
        )
    assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
    assert "no answer" in done.stderr.strip().splitlines()[-1]


def test_the_ui_on_a_taken_port_is_an_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        done, seconds = _qeval("ui", "--port", port, env=env_with(QEVAL_WORKDIR=str(tmp_path)))
    assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr.strip().splitlines()[-1]


def _password_kept(folder: Path, env: dict[str, str], session: Path) -> subprocess.CompletedProcess:
    """`qeval size --log` of a copy of the session's folder to a live MLflow server whose address holds a
    password, MLflow's "View run" lines turned on. Beside the tests (tests/lanes.py): a server's start."""
    from pipelines.core.system.procs import running

    own = copy_root(session, folder / "own")
    store = folder / "server"
    store.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{store}/mlflow.db",
        "--default-artifact-root",
        str(store / "artifacts"),
        "--workers",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
    ]
    with running(cmd, folder / "mlflow.log", 120, "mlflow server", env=UI_ENV) as url:  # as `qeval ui`'s
        uri = url.replace("http://", f"http://alice:{PASSWORD}@")
        # qeval turns MLflow's "View run ... at:" lines off; a user who turns them on gets them without credentials
        env = {**root_env(own, env), "MLFLOW_TRACKING_URI": uri, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "false"}
        done, _ = _qeval("size", "--log", "--model", "ref-small", "--precision", "awq", env=env, timeout=300)
    return done


password_kept = lanes.side_job("password_kept", _password_kept, after="builds")


@pytest.mark.slow
def test_a_live_tracking_server_never_sees_its_password_printed(password_kept):
    done = password_kept
    assert done.returncode == 0, done.stderr[-2000:]
    assert "View run" in done.stdout  # MLflow's own line, printed without the credentials
    assert PASSWORD not in done.stdout + done.stderr


def _transformers_server(checkpoint: str, log: Path) -> tuple[subprocess.Popen, str]:
    from pipelines.core.system.procs import free_port as port_free
    from pipelines.core.system.procs import wait_healthy
    from pipelines.stages.engines import transformers_command

    port = port_free()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            transformers_command(checkpoint, False, str(port)),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 300, log, "transformers serve")
    return proc, url


@pytest.mark.slow
def test_a_server_that_dies_mid_sweep_fails_the_stage_and_is_not_cached(own_root, tmp_path):
    from memory_tracker import MemoryTracker

    from pipelines.core.card.cards import load_card
    from pipelines.core.framework.weights import checkpoint_for
    from pipelines.core.store.manifests import finished
    from pipelines.core.store.results import Served
    from pipelines.core.system.errors import QevalError
    from pipelines.core.system.procs import stop_process_group
    from pipelines.stages.serve import serve

    card = load_card("ref-small")
    card = card.model_copy(update={"server": card.server.model_copy(update={"requests_per_user": 20})})
    checkpoint, _ = checkpoint_for(card, "gptq")
    proc, url = _transformers_server(checkpoint, tmp_path / "server.log")

    class KillAfterFirstLevel(logging.Handler):
        """Stops the server when the first level's progress line comes: mid-sweep, never in the warm-up."""

        def emit(self, record: logging.LogRecord) -> None:
            if "concurrency 1:" in record.getMessage():
                threading.Thread(target=stop_process_group, args=(proc, 0.1)).start()

    sweep_log = logging.getLogger("pipelines.stages.sweep")
    killer, level = KillAfterFirstLevel(), sweep_log.level
    sweep_log.addHandler(killer)
    sweep_log.setLevel(logging.INFO)
    try:
        t0 = time.monotonic()
        with pytest.raises(QevalError, match="stopped answering during the sweep"):
            serve(card, "gptq", MemoryTracker(card.name), url=url)
        assert time.monotonic() - t0 < 120
    finally:
        sweep_log.removeHandler(killer)
        sweep_log.setLevel(level)
        stop_process_group(proc)
    assert finished(card.name, "gptq", Served) is None  # nothing cached: a rerun sweeps again
    failed = own_root / "artifacts" / "ref-small" / "gptq" / "serve.failed"
    assert (failed / "requests.csv").is_file()  # every request kept, the failed ones among them


def _sigterm_served(folder: Path, env: dict[str, str], session: Path) -> tuple[Path, subprocess.CompletedProcess, list]:
    """`qeval serve` of int8 on `transformers serve` in a copy of the session's folder, sent SIGTERM once its
    server has started: the build's folder, how it ended, and the processes that ran its checkpoint then.
    Beside the tests (tests/lanes.py): a server's start is most of it."""
    root = copy_root(session, folder / "own")
    card_file = root / "cards" / "ref-small.yaml"
    card_file.write_text(card_file.read_text().replace("server:\n", "server:\n  engine: transformers\n", 1))
    build = root / "artifacts" / "ref-small" / "int8"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines", "serve", "--model", "ref-small", "--precision", "int8"],
        cwd=REPO,
        env=root_env(root, env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not any(
        "Application startup complete" in p.read_text(errors="replace")
        for p in build.glob("serve.partial-*/server.log")
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.5)
    running = processes_naming(str(build / "quantize" / "checkpoint"))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return build, subprocess.CompletedProcess(proc.args, proc.returncode, out, err), running


sigterm_served = lanes.side_job("sigterm_served", _sigterm_served, after="builds")


@pytest.mark.slow
def test_sigterm_stops_the_server_and_fails_the_stage(sigterm_served):
    build, done, running = sigterm_served
    assert running  # the server ran
    assert done.returncode == 130, done.stderr[-2000:]
    assert "interrupted" in done.stderr.strip().splitlines()[-1], done.stderr[-3000:]
    assert processes_naming(str(build / "quantize" / "checkpoint")) == []  # stopped with its children
    assert not (build / "serve" / "manifest.json").exists() and (build / "serve.failed").is_dir()


def test_a_pickle_checkpoint_is_refused_before_anything_loads_it(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    for f in (REPO / "refmodel/ref-lm").iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"a pickle is never opened")
    env = card_env(tmp_path, "pickled", f"source:\n  path: {folder}\n")
    done, seconds = _qeval("quantize", "--model", "pickled", "--precision", "bf16", env=env)
    assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "has no *.safetensors weights (it has pytorch_model.bin)" in last and "safetensors only" in last
    assert not (tmp_path / "artifacts" / "pickled" / "bf16" / "quantize" / "manifest.json").exists()


HUBS = ("nothing listening", "never answers")


def _unreachable_hubs(folder: Path, env: dict[str, str]) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """`qeval quantize` of a hub model whose hub has nobody listening, then one that never answers: each waits
    out its timeouts, so they run beside the tests (tests/lanes.py)."""
    source = "source:\n  hub_id: acme/tiny-llama\n  revision: 0123456789abcdef0123456789abcdef01234567\n"
    done = {}
    for hub in HUBS:
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            if hub == "never answers":
                silent.listen(8)  # the kernel accepts; nobody answers
            port = silent.getsockname()[1]
            here = folder / hub.replace(" ", "-")
            here.mkdir()
            hub_env = {**card_env(here, "hubbed", source, env), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
            hub_env.pop("HF_HUB_OFFLINE", None)
            done[hub] = _qeval("quantize", "--model", "hubbed", "--precision", "bf16", env=hub_env)
    return done


unreachable_hubs = lanes.side_job("unreachable_hubs", _unreachable_hubs)


@pytest.mark.parametrize("hub", HUBS)
def test_a_hub_that_cannot_be_reached_fails_fast(unreachable_hubs, hub):
    done, seconds = unreachable_hubs[hub]
    assert done.returncode == 2 and seconds < 40, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "not in the local cache and the hub at http://127.0.0.1:" in last
    assert ("no answer" if hub == "never answers" else "ConnectError") in last
    assert len(done.stderr.strip().splitlines()) <= 3  # no traceback


def test_models_checks_the_files_a_card_names(tmp_path):
    env = card_env(tmp_path, "lost", "source:\n  path: refmodel/no-such-model\n")
    text = (tmp_path / "cards" / "lost.yaml").read_text().replace("calibration.jsonl", "no-such.jsonl")
    (tmp_path / "cards" / "lost.yaml").write_text(text)
    done, seconds = _qeval("models", env=env)
    assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "no checkpoint at" in last and "refmodel/no-such-model" in last
    assert "calibration.dataset" in last and "no-such.jsonl does not exist" in last


def test_a_store_that_turns_read_only_mid_stage_says_so(tmp_path, monkeypatch):
    from pipelines.core.framework.runner import run_stage
    from pipelines.core.store.manifests import finished
    from pipelines.core.store.results import Quantized
    from pipelines.core.system.errors import QevalError
    from pipelines.tracking.mlflow_tracker import MlflowTracker

    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker("m")
    db = tmp_path / "mlruns" / "mlflow.db"

    def work(out: Path) -> Quantized:  # the store turns read-only while the stage runs
        if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
            pytest.skip("this file system cannot make a file immutable (chattr +i), which root needs here")
        return Quantized(checkpoint="x", checkpoint_bytes=1, scheme="s")

    try:
        with pytest.raises(QevalError, match=r"cannot be written \(disk I/O error: a read-only, full or immutable"):
            run_stage(tracker, "bf16", Quantized, {"k": 1}, work)
    finally:
        subprocess.run(["chattr", "-i", str(db)], capture_output=True)
    assert finished("m", "bf16", Quantized) is None
