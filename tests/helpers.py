"""What the tests share that is not a fixture: the repository, `qeval` as a user runs it, environments for
a work folder of their own (its MLflow store seeded), and the checks several files make."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from pipelines.core.system.procs import free_port

REPO = Path(__file__).resolve().parent.parent
# A two-layer Qwen2 config (tests/test_shape.py serves it with random weights; tests/test_init.py writes cards)
TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "vocab_size": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
__all__ = [
    "REPO",
    "card_env",
    "env_with",
    "free_port",
    "last_json_line",
    "processes_naming",
    "qeval",
    "qeval_command",
    "qeval_timed",
    "root_env",
    "same_logits",
    "seed_store",
]


def env_with(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """This environment (or `base`) without a tracking URI of its own, plus `extra`."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "MLFLOW_TRACKING_URI"}
    env.update(extra)
    return env


_EMPTY_STORE: dict[str, Path] = {}  # "home": its folder, the session's (tests/conftest.py); "db": once made
_EMPTY_STORE_LOCK = threading.Lock()


def seed_store(root: Path) -> Path:
    """Work folder `root`, its default MLflow store (pipelines/tracking/store.py) started, where it has none, as a
    copy of an empty one MLflow made once this session. MLflow makes a store by running its schema migrations
    one by one, seconds of CPU, and the suite's work folders would make dozens; qeval opens a store that is
    there as it does on every command after a folder's first. A test of making one (marked `new_store`) makes
    its own from nothing."""
    from pipelines.tracking.store import sqlite_path, sqlite_store

    db = sqlite_path(sqlite_store(root / "mlruns"))  # the address qeval finds it at, as a file
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_empty_store(), db)
    return root


def empty_store_in(home: Path) -> None:
    """Where the session's empty store is made, on first use (tests/conftest.py)."""
    _EMPTY_STORE["home"] = home


def _empty_store() -> Path:
    with _EMPTY_STORE_LOCK:
        if "db" not in _EMPTY_STORE:
            from mlflow.tracking import MlflowClient

            from pipelines.tracking.store import sqlite_path, sqlite_store

            uri = sqlite_store(_EMPTY_STORE["home"])
            MlflowClient(uri).search_experiments()  # its tables made, and its Default experiment
            _EMPTY_STORE["db"] = sqlite_path(uri)
        return _EMPTY_STORE["db"]


def card_env(tmp_path: Path, name: str, source: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ref-lm's card named `name` with another `source:` section in `tmp_path`/cards, and the
    environment of a `qeval` working in `tmp_path` with it (from `base`, else this one), its store seeded."""
    text = (REPO / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", f"name: {name}")
    text = text.replace("source:\n  path: refmodel/ref-lm\n", source)
    cards = seed_store(tmp_path) / "cards"
    cards.mkdir(exist_ok=True)
    (cards / f"{name}.yaml").write_text(text)
    return env_with(base, QEVAL_WORKDIR=str(tmp_path), QEVAL_CARDS_DIR=str(cards), HF_HOME=str(tmp_path / "hf"))


def processes_naming(text: str) -> list[int]:
    """The processes (this one aside) whose command line holds `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if proc.name.isdigit() and int(proc.name) != os.getpid() and text.encode() in cmdline:
            found.append(int(proc.name))
    return found


def root_env(root: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a `qeval` process working in `root` (its artifacts, store and cards), from `base`
    (else this one); its store seeded where it has none."""
    return env_with(base, QEVAL_WORKDIR=str(seed_store(root)), QEVAL_CARDS_DIR=str(root / "cards"))


def qeval_command(*args: str) -> list[str]:
    """The command line of `qeval ARGS`, run from the repository."""
    return [sys.executable, "-m", "pipelines", *args]


def qeval(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`qeval ARGS` in a process of its own, from the repository, as a user runs it."""
    return subprocess.run(
        qeval_command(*args),
        cwd=REPO,
        env=env or env_with(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def qeval_timed(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """qeval() and the seconds it took."""
    t0 = time.monotonic()
    done = qeval(*args, env=env, timeout=timeout)
    return done, time.monotonic() - t0


def last_json_line(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def same_logits(a: Path, b: Path) -> bool:
    """Two checkpoint folders load (safetensors, no remote code) and give identical logits on fixed tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.arange(1, 33).unsqueeze(0)
    out = []
    for folder in (a, b):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, use_safetensors=True).eval()
        with torch.no_grad():
            out.append(model(input_ids=ids).logits)
    return torch.equal(*out)


def accuracy_result(scores: dict, **fields):
    """An lm-eval result as qeval keeps it, with only `scores` (and any field given) filled in."""
    from eval.quality.records import AccuracyResult

    base = dict(n_samples={}, versions={}, chance={}, datasets={}, backend="hf", lm_eval_version="x", seconds=1)
    return AccuracyResult(scores=scores, **{**base, "peak_rss_mb": 1, **fields})
