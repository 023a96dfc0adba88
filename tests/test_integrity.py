"""Integrity, as a careless or hostile user meets it on a copy of a finished run: what is gated is what
ships, bit for bit; weights that are not whole files, names that climb out of the work folder, a copied
store, a server orphaned by a killed run, a stage tagged done before its files are up, code a model ships,
an engine setting that does not work. Each is refused in one line, within seconds."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, card_env, env_with, processes_naming, root_env
from helpers import qeval_timed as _qeval
from memory_tracker import MemoryTracker

from pipelines.core.card.cards import load_card
from pipelines.core.store.results import Quantized
from pipelines.core.system.errors import QevalError
from pipelines.core.system.integrity import Tampered, check_safetensors, file_hashes

REF = REPO / "refmodel" / "ref-lm"


def _flip_a_byte(path: Path) -> None:
    """Change one byte of `path` in a new file (the session's checkpoints are hard-linked into own_root)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.unlink()
    path.write_bytes(bytes(data))


def _base_copy(tmp_path: Path, name: str = "base") -> Path:
    folder = tmp_path / name
    shutil.copytree(REF, folder)
    return folder


# ---- 1. a checkpoint changed after its build ---------------------------------------------------------


@pytest.mark.integration
def test_a_checkpoint_changed_after_its_build_is_refused_by_every_reader(own_root):
    from pipelines.core.framework.weights import checkpoint_for
    from pipelines.decision.gate import gate
    from pipelines.present.shipcard import ship_card
    from pipelines.stages.quantize import quantize

    card = load_card("ref-small")
    weights = own_root / "artifacts/ref-small/int8/quantize/checkpoint/model.safetensors"
    _flip_a_byte(weights)
    tracker = MemoryTracker(card.name)
    with pytest.raises(Tampered, match=r"int8 quantize: .*model\.safetensors has changed .*--force"):
        quantize(card, "int8", tracker)  # not "unchanged, skipped"
    with pytest.raises(Tampered, match=r"ref-small@int8: .*model\.safetensors has changed"):
        checkpoint_for(card, "int8")  # what evaluate, bench and serve read a checkpoint through
    with pytest.raises(Tampered, match=r"model\.safetensors"):
        gate(card, tracker, ship_card=ship_card)
    assert tracker.shipped() is None

    (weights.parent / "extra.py").write_text("print('hello')\n")  # a file added is a change too
    done, seconds = _qeval("evaluate", "--model", "ref-small", "--precision", "int8", env=root_env(own_root))
    assert done.returncode == 2 and seconds < 60, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "model.safetensors has changed" in last and "(and 1 more)" in last
    assert "qeval quantize --model ref-small --precision int8 --force" in last


@pytest.mark.integration
def test_pull_delivers_only_the_bytes_the_gate_judged(own_root, tmp_path):
    from pipelines.core.framework.weights import checkpoint_for
    from pipelines.decision.gate import gate
    from pipelines.present.shipcard import ship_card
    from pipelines.tracking.readback import pull, verify

    path = own_root / "cards" / "ref-small.yaml"  # a lenient policy, so that a build ships
    text = path.read_text()
    path.write_text(
        text[: text.index("gate:")] + "gate:\n  baseline: bf16\n  min_recovery: 0.5\n  max_length_change: null\n"
        "  min_speedup: null\n  verdicts: bootstrap\n"  # a sequence decides nothing on six documents
    )
    card = load_card("ref-small")
    tracker = MemoryTracker(card.name)
    decision = gate(
        card, tracker, ship_card=ship_card
    )  # the gate logs the checkpoint and its record where the run has neither
    assert decision.chosen, decision.why
    info = tracker.shipped()
    assert info["files"]  # the digest of the gated file list, on the registered version

    got = pull(tracker, "ship", tmp_path / "ok")
    folder, _ = checkpoint_for(card, decision.chosen)  # a KV-cache variant ships its precision's checkpoint
    assert got["verified"] == len(file_hashes(Path(folder)))
    assert verify(tracker, info, tmp_path / "ok") == got["verified"]  # README.md (the ship card) is allowed
    (tmp_path / "ok" / "config.json").write_text("{}")
    with pytest.raises(Tampered, match=r"ok/config\.json has changed"):
        verify(tracker, info, tmp_path / "ok")

    run = tracker.runs[info["run_id"]]
    weights = f"{Quantized.STAGE}/checkpoint/model.safetensors"
    kept = run.artifacts[weights]
    run.artifacts[weights] = kept[:-1] + bytes([kept[-1] ^ 1])  # the store's copy changed
    with pytest.raises(Tampered, match=r"model\.safetensors has changed"):
        pull(tracker, "ship", tmp_path / "changed")
    assert not (tmp_path / "changed").exists()  # nothing half-delivered

    # the record changed with the files: the digest on the registered version still tells
    record = json.loads(run.artifacts["ship/files.json"])
    record["model.safetensors"] = "0" * 64
    run.artifacts["ship/files.json"] = json.dumps(record).encode()
    with pytest.raises(Tampered, match=r"\(ship/files\.json\) are not those the gate registered"):
        pull(tracker, "ship", tmp_path / "both")


# ---- 2. weights that are not whole files --------------------------------------------------------------


def test_weights_must_be_whole_regular_safetensors_files(tmp_path):
    good = REF / "model.safetensors"
    check_safetensors(good)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(QevalError, match=r"cut\.safetensors is [\d,]+ bytes but its safetensors header accounts for"):
        check_safetensors(cut)
    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    with pytest.raises(QevalError, match=r"not a regular file \(it points at /dev/zero\)"):
        check_safetensors(tmp_path / "zero.safetensors")
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(QevalError, match="not a regular file"):
        check_safetensors(tmp_path / "fifo.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(QevalError, match="no readable header"):
        check_safetensors(tmp_path / "junk.safetensors")


@pytest.mark.integration
@pytest.mark.parametrize("fault", ["/dev/zero", "fifo", "truncated"])
def test_models_and_quantize_refuse_weights_that_never_end_or_are_cut(tmp_path, fault):
    base = _base_copy(tmp_path)
    weights = base / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    if fault == "/dev/zero":
        weights.symlink_to("/dev/zero")
    elif fault == "fifo":
        os.mkfifo(weights)
    else:
        weights.write_bytes(data[:7_000_000])
    env = card_env(tmp_path, "broken", f"source:\n  path: {base}\n")
    for args in (("models",), ("quantize", "--model", "broken", "--precision", "bf16")):
        done, seconds = _qeval(*args, env=env)
        assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
        assert "model.safetensors" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "artifacts/broken/bf16/quantize/manifest.json").exists()  # nothing marked done


# ---- 3. a model name that climbs out --------------------------------------------------------------------


@pytest.mark.integration
def test_a_model_name_is_checked_before_any_path_is_built(tmp_path):
    (tmp_path / "cards" / "sub").mkdir(parents=True)
    outside = tmp_path / "outside.yaml"
    outside.write_text((REPO / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", "name: outside"))
    env = env_with(QEVAL_WORKDIR=str(tmp_path / "work"), QEVAL_CARDS_DIR=str(tmp_path / "cards" / "sub"))
    for command in ("quantize", "gate"):
        done, seconds = _qeval(command, "--model", "../../outside", env=env)
        assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
        assert "'../../outside' is not a model card name" in done.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cards", "outside.yaml"]  # nothing written anywhere


# ---- 4. a copied work folder ------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_copied_work_folder_does_not_write_into_the_original(tmp_path, monkeypatch):
    from pipelines.tracking.mlflow_tracker import MlflowTracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path / "w"))
    MlflowTracker("m").build_run("bf16")
    shutil.copytree(tmp_path / "w", tmp_path / "w2")
    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path / "w2"))
    with pytest.raises(
        QevalError, match=r"keeps its artifacts in .*/w/mlruns/artifacts, outside .*/w2/mlruns: it was copied"
    ):
        MlflowTracker("m")


# ---- 5. a server outlives the run that started it ---------------------------------------------------------

_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
_OWNER = """
import sys, time
from pathlib import Path
from pipelines.core.system.procs import running
with running([sys.executable, "-c", sys.argv[1], "{port}", sys.argv[2]], Path(sys.argv[3]), 30, "a server") as url:
    print(url, flush=True)
    time.sleep(600)
"""


@pytest.mark.integration
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_server_dies_with_the_process_that_started_it(tmp_path, how):
    marker = f"qeval-test-server-{os.getpid()}-{how}"
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, _SERVER, marker, str(tmp_path / "server.log")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout.readline().startswith("http://127.0.0.1:")
        assert len(processes_naming(marker)) >= 2  # the watchdog and the server
        owner.send_signal(how)  # SIGKILL: an OOM killer or a CI hard timeout; nothing of qeval's runs after it
        owner.wait(10)
        deadline = time.monotonic() + 10
        while processes_naming(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_naming(marker) == []
    finally:
        owner.kill()
        for pid in processes_naming(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.integration
def test_a_server_runs_below_the_priority_of_the_process_that_measures_it(tmp_path):
    """running(nice=N), as every server a sweep measures runs (sweep.SERVER_NICE): the watchdog and the server N
    steps below this process, their session's scheduling group too where the kernel groups sessions, and the
    server's log says what was set."""
    from pipelines.core.system.procs import running

    marker, log = f"qeval-test-nice-{os.getpid()}", tmp_path / "server.log"
    with running([sys.executable, "-c", _SERVER, "{port}", marker], log, 30, "a server", nice=7):
        said = log.read_text()
        pids = processes_naming(marker)
        assert len(pids) >= 2  # the watchdog and the server
        for pid in pids:
            assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16]) == os.nice(0) + 7
            if "its session's scheduling group at nice 7" in said:
                assert Path(f"/proc/{pid}/autogroup").read_text().split()[-1] == "7"
    assert "qeval: the server runs below normal priority: nice 7" in said


# ---- 8. code a model ships --------------------------------------------------------------------------------


def test_a_build_leaves_out_code_its_card_does_not_trust(tmp_path):
    from quant.build import drop_remote_code

    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "m.M"}, "model_type": "qwen2"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["t.T", None]}}))
    (tmp_path / "m.py").write_text("import os\n")
    assert drop_remote_code(tmp_path) == ["m.py", "config.json:auto_map", "tokenizer_config.json:auto_map"]
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "qwen2"}
    assert not (tmp_path / "m.py").exists()


def test_reading_a_card_says_its_model_ships_code_that_is_not_run(tmp_path, cards, caplog):
    from pipelines.core.framework.weights import resolve_weights

    base = _base_copy(tmp_path)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.M"}}))
    (base / "m.py").write_text("import os\n")
    text = (REPO / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", "name: coded")
    cards("coded", text.replace("path: refmodel/ref-lm", f"path: {base}"))
    resolve_weights(load_card("coded"))
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("names code of its own (m.py)" in m and "source.trust_remote_code is off" in m for m in said)


# ---- 9. an engine setting that does not work --------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("python", ["/no/such/python", "/usr/bin/false"])
def test_an_explicit_vllm_python_that_does_not_work_is_an_error(monkeypatch, python):
    from pipelines.stages import engines

    monkeypatch.setenv("QEVAL_VLLM_PYTHON", python)
    engines.find_vllm.cache_clear()
    try:
        with pytest.raises(QevalError, match=rf"QEVAL_VLLM_PYTHON={python} is not a Python with vLLM installed"):
            engines.find_vllm()
    finally:
        engines.find_vllm.cache_clear()


# ---- 10. a stage tagged done before its files are up -------------------------------------------------------


@pytest.mark.integration
def test_a_stage_whose_upload_is_cut_short_is_not_tagged_done(tmp_path, monkeypatch):
    from pipelines.core.framework.runner import run_stage
    from pipelines.core.store.manifests import finished
    from pipelines.core.store.results import Quantized
    from pipelines.tracking.mlflow_tracker import MlflowTracker

    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker("m")

    def work(out: Path) -> Quantized:
        (out / "records.jsonl").write_text("{}\n")
        return Quantized(checkpoint="x", checkpoint_bytes=1, scheme="s")

    def cut(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tracker.client, "log_artifact", cut)
    with pytest.raises(QevalError, match="failed"):
        run_stage(tracker, "bf16", Quantized, {"k": 1}, work)
    assert tracker.logged_digest(tracker.build_run("bf16"), "quantize") is None  # not done in the store
    assert finished("m", "bf16", Quantized) is None  # nor here


def test_a_stage_read_back_without_all_its_files_is_refused(tmp_path, monkeypatch):
    from pipelines.core.framework.runner import run_stage
    from pipelines.core.store.results import Quantized
    from pipelines.tracking.readback import fetch_stage

    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path))
    tracker = MemoryTracker("m")

    def work(out: Path) -> Quantized:
        (out / "records.jsonl").write_text("{}\n")
        return Quantized(checkpoint="x", checkpoint_bytes=1, scheme="s")

    record = run_stage(tracker, "bf16", Quantized, {"k": 1}, work)
    artifacts = tracker.runs[record.run_id].artifacts
    artifacts["quantize/records.jsonl"] = b'{"changed": 1}\n'  # a store changed after the stage: its digest tells
    with pytest.raises(QevalError, match=r"tagged done but of its manifest's files records\.jsonl has changed"):
        fetch_stage(tracker, record.run_id, "bf16", "quantize", tmp_path / "elsewhere")
    del artifacts["quantize/records.jsonl"]  # tagged done, a file short
    with pytest.raises(QevalError, match=r"tagged done but of its manifest's files records\.jsonl is missing"):
        fetch_stage(tracker, record.run_id, "bf16", "quantize", tmp_path / "elsewhere")


# ---- 6. grids no model or machine can hold ----------------------------------------------------------------


def _ref_card(cards, name: str, **replace: str):
    text = (REPO / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", f"name: {name}")
    for a, b in replace.items():
        assert a in text, a
        text = text.replace(a, b)
    cards(name, text)
    return name


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("batch_sizes: [100000]", "speed.batch_sizes.0"),
        ("concurrency: [100000]", "speed.concurrency.0"),
        ("output_lengths: [10000000]", "speed.output_lengths.0"),
    ],
)
def test_a_grid_point_beyond_any_machine_is_refused_when_the_card_is_read(cards, line, key):
    grid = {
        "batch_sizes: [1, 4]": "batch_sizes: [1, 4]",
        "concurrency: [1, 4, 16]": "concurrency: [1, 4, 16]",
        "output_lengths: [32]": "output_lengths: [32]",
    }
    old = next(k for k in grid if k.split(":")[0] == line.split(":")[0])
    name = _ref_card(cards, "absurd", **{old: line})
    with pytest.raises(QevalError, match=rf"key '{re.escape(key)}': Input should be less than or equal to"):
        load_card(name)


def test_lengths_are_checked_against_the_model_and_memory_against_this_machine(cards, monkeypatch):
    from pipelines.core.framework import demands

    card = load_card(_ref_card(cards, "long", **{"output_lengths: [32]": "output_lengths: [600]"}))
    assert demands.length_problems(card) == [
        f"model 'long': speed.input_lengths and output_lengths reach 728 tokens, and the model has 512 positions "
        f"({REF / 'config.json'}); shorten the longest",
        "model 'long': scenario 'default' asks for 600 output tokens, and the model has 512 positions; shorten its "
        "output_len",
    ]
    with pytest.raises(QevalError, match="reach 728 tokens"):
        demands.check_bench(card, in_host_memory=True)

    card = load_card("ref-lm")
    demands.check_bench(card, in_host_memory=True)  # the shipped grid fits
    monkeypatch.setattr(demands, "available_bytes", lambda: 2_000_000)
    with pytest.raises(QevalError, match=r"needs about \d MB beside the weights, and this machine has 2 MB available"):
        demands.check_bench(card, in_host_memory=True)
    demands.check_bench(card, in_host_memory=False)  # a GPU's memory is the size stage's
    monkeypatch.setattr(demands.resource, "getrlimit", lambda what: (64, 64))
    with pytest.raises(QevalError, match=r"reaches 16 users, one connection each, and this process may open 64 files"):
        demands.check_sweep(card)


# ---- 7. one line, not a traceback ---------------------------------------------------------------------------


def test_task_files_and_task_names_are_checked_when_the_card_is_read(cards, tmp_path):
    from pipelines.core.framework.demands import task_problems

    tasks = tmp_path / "tasks"
    shutil.copytree(REPO / "eval/tasks/refkjv", tasks)
    (tasks / "unused.yaml").write_text("task: x\n  bad: [indent\n")
    name = _ref_card(
        cards,
        "tasked",
        **{"include_path: eval/tasks/refkjv": f"include_path: {tasks}", "[refkjv_ppl,": "[refkjv_pplx,"},
    )
    problems = task_problems(load_card(name))
    assert len(problems) == 2, problems
    assert f"{tasks / 'unused.yaml'}:2:" in problems[0] and "is not valid YAML" in problems[0]
    assert "accuracy task 'refkjv_pplx' is defined neither in" in problems[1] and "'refkjv_ppl'?" in problems[1]
    assert task_problems(load_card("ref-lm")) == []


def test_a_card_nested_too_deeply_is_one_line(cards):
    cards("deep", "name: deep\ndescription: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(QevalError, match="nested too deeply to be a model card"):
        load_card("deep")


@pytest.mark.integration
def test_bad_environment_settings_are_one_line(tmp_path):
    done, seconds = _qeval("models", env=env_with(QEVAL_PROGRESS_S="abc", QEVAL_WORKDIR=str(tmp_path)))
    assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "qeval: error: QEVAL_PROGRESS_S is not a number of seconds from 1 to 86400 (a day); unset it for 30"
    ]


def test_pull_into_a_place_it_cannot_write_is_one_line(tmp_path):
    from pipelines.tracking.readback import pull

    blocked = tmp_path / "a-file"  # a place no one can make a folder in, root included (unlike a read-only one)
    blocked.write_text("")
    with pytest.raises(QevalError, match=r"cannot write the build into .*a-file/ship: File exists; name a writable"):
        pull(MemoryTracker("ref-small"), "ship", blocked / "ship")
