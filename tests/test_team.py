"""Team scale for real: PostgreSQL, an MLflow server over it with proxied artifacts, a Ray cluster.

Two `ref-small` builds fan out on Ray and log to the server; the gate then runs on a machine with an empty
folder and reaches the decision the run reached; the shipped build is pulled into an empty folder and
gives the gated build's logits; no credential appears in anything qeval printed, logged or wrote.

Everything runs inside a network namespace of its own that has only loopback (`unshare -n`): Ray listens
on all interfaces and connects through the machine's own address unless that is the only one it has.
The processes inside are started with `nsenter`; this process (outside) only reads their output and files.
All of it runs in a thread beside the other tests (tests/lanes.py), started with the session's pipeline run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lanes
import pytest
from helpers import REPO, last_json_line, same_logits

from conftest import small_card_text
from pipelines.tracking.store import UI_ENV

PG_BIN = next((p.parent for p in sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))), None)
VENV_BIN = Path(sys.executable).parent
WHY_NOT = (
    "needs root (unshare -n, nsenter)"
    if os.geteuid() != 0
    else "needs PostgreSQL's server (Debian package postgresql; make test installs it)"
    if PG_BIN is None
    else "needs Ray (pip install -e '.[ray]'; make test installs it)"
    if not (VENV_BIN / "ray").exists()
    else None
)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]


class Namespace:
    """A network namespace with only `lo`, held open by a sleeping process; commands run in it via nsenter, with
    the environment this process had when it was made (tests running meanwhile change this process's own)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.holder = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && exec sleep infinity"])
        for _ in range(50):  # until `lo` is up in there
            if "127.0.0.1" in self.run(["ip", "-brief", "addr"]).stdout:
                return
            time.sleep(0.1)
        raise RuntimeError("the network namespace's loopback did not come up")

    def cmd(self, args: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", "--", *args]

    def run(self, args: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env)
        return subprocess.run(self.cmd(args), capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)

    def start(self, args: list[str], log: Path, **kw) -> subprocess.Popen:
        kw.setdefault("env", self.env)
        with log.open("w") as f:
            return subprocess.Popen(self.cmd(args), stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **kw)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


def _as_postgres(args: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: its tools run as the `postgres` user there."""
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


@contextmanager
def _team(root: Path) -> Iterator[dict]:
    """PostgreSQL, an MLflow server over it (proxied artifacts) and a Ray head, in one loopback namespace."""
    ns = Namespace()
    # Ray's unix sockets must fit in 107 bytes, and the postgres user must reach its cluster (pytest's own
    # folders are private to root): a short folder of their own
    short = Path(tempfile.mkdtemp(prefix="qteam", dir="/tmp"))
    short.chmod(0o755)
    ray_tmp, pg = short / "ray", short / "pg"
    procs: list[subprocess.Popen] = []
    password = secrets.token_hex(12)
    pg.mkdir()
    (pg / "pw").write_text(password + "\n")
    if os.geteuid() == 0:
        for path in (pg, pg / "pw"):
            shutil.chown(path, "postgres")
    try:
        init = subprocess.run(
            _as_postgres(
                [
                    str(PG_BIN / "initdb"),
                    "-D",
                    str(pg / "data"),
                    "-U",
                    "qeval",
                    "-A",
                    "scram-sha-256",
                    f"--pwfile={pg / 'pw'}",
                ]
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert init.returncode == 0, init.stderr
        (pg / "pw").unlink()
        opts = f"-c listen_addresses=127.0.0.1 -p 5432 -k {pg}"
        start = ns.run(
            _as_postgres(
                [
                    str(PG_BIN / "pg_ctl"),
                    "-D",
                    str(pg / "data"),
                    "-o",
                    opts,
                    "-l",
                    str(pg / "server.log"),
                    "-w",
                    "start",
                ]
            )
        )
        assert start.returncode == 0, start.stderr + start.stdout
        made = ns.run(
            [str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-U", "qeval", "mlflow"],
            env={**ns.env, "PGPASSWORD": password},
        )
        assert made.returncode == 0, made.stderr

        store = root / "artifact-store"  # stands in for an object store behind the server
        backend = f"postgresql://qeval:{password}@127.0.0.1:5432/mlflow"
        server = [
            str(VENV_BIN / "python"),
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            backend,
            "--serve-artifacts",
            "--artifacts-destination",
            str(store),
            "--host",
            "127.0.0.1",
            "--port",
            "5000",
            "--workers",
            "1",
        ]
        # without MLflow's job runner, as `qeval ui` starts its server: qeval submits no job (UI_ENV)
        procs.append(ns.start(server, root / "mlflow-server.log", env={**ns.env, **UI_ENV}))
        uri = "http://127.0.0.1:5000"
        # one process polls (a Python started per poll costs the server's start more than the polls do)
        wait = (
            "import sys, time, httpx\n"
            "with httpx.Client() as c:\n"
            "    for _ in range(240):\n"
            "        try:\n"
            f"            if c.get('{uri}/health').status_code == 200:\n"
            "                sys.exit(0)\n"
            "        except httpx.TransportError:\n"
            "            pass\n"
            "        time.sleep(0.5)\n"
            "sys.exit(1)"
        )
        if ns.run([str(VENV_BIN / "python"), "-c", wait], timeout=150).returncode != 0:
            pytest.fail("the MLflow server did not come up: " + (root / "mlflow-server.log").read_text()[-2000:])

        worker = root / "worker"  # the Ray node's own artifacts cache
        head = ns.run(
            [
                str(VENV_BIN / "ray"),
                "start",
                "--head",
                "--node-ip-address=127.0.0.1",
                "--port=6379",
                "--num-cpus=2",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={ray_tmp}",
            ],
            env={**ns.env, "QEVAL_WORKDIR": str(worker), "RAY_USAGE_STATS_ENABLED": "0"},
        )
        assert head.returncode == 0, head.stderr[-2000:]
        yield {
            "ns": ns,
            "root": root,
            "uri": uri,
            "ray": "127.0.0.1:6379",
            "worker": worker,
            "store": store,
            "password": password,
        }
    finally:
        ns.run([str(VENV_BIN / "ray"), "stop", "--force"], timeout=60)
        for p in procs:
            os.killpg(p.pid, 15)
            p.wait(timeout=30)
        ns.run(_as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(pg / "data"), "-m", "fast", "stop"]))
        ns.close()
        shutil.rmtree(short, ignore_errors=True)


def _card(folder: Path) -> Path:
    """ref-small (tests/conftest.py) with three builds, and a lenient policy so that one ships and can be pulled."""
    text = small_card_text().replace("precisions: [bf16, fp8, int8, awq, gptq]", "precisions: [bf16, int8, fp8]")
    text = (
        text[: text.index("gate:")]
        + "gate:\n  baseline: bf16\n  min_recovery: 0.5\n  max_length_change: null\n  min_speedup: null\n"
        + "  verdicts: bootstrap\n"  # a confidence sequence decides nothing on six documents
    )
    cards = folder / "cards"
    cards.mkdir(parents=True)
    (cards / "ref-small.yaml").write_text(text)
    return cards


def _qeval(team: dict, workdir: Path, cards: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {
        **team["ns"].env,
        "QEVAL_WORKDIR": str(workdir),
        "QEVAL_CARDS_DIR": str(cards),
        "MLFLOW_TRACKING_URI": team["uri"],
        "QEVAL_PROGRESS_S": "10",
    }
    return team["ns"].run([str(VENV_BIN / "qeval"), *args], env=env, cwd=REPO, timeout=timeout)


def _start(folder: Path) -> lanes.Work:
    """The team's servers and the test's commands, beside the other tests (tests/lanes.py): each is a process of
    its own, which the thread waits on; what they left is the lane's value."""

    def work() -> dict:
        with _team(folder) as team:
            return _two_builds_on_ray_then_the_gate_from_an_empty_folder_then_pull(team)

    return lanes.work(folder, work, timeout_s=1800)


if WHY_NOT is None:
    lanes.AT_START["team_run"] = _start


@pytest.fixture
def team_run(request, tmp_path_factory) -> Callable[[], object]:
    """Waits for the lane (started when the session's builds were measured): (its folder, what its commands left),
    or what it raised."""
    return lambda: lanes.ended(request, tmp_path_factory, "team_run")


def test_two_builds_on_ray_then_the_gate_from_an_empty_folder_then_pull(team_run):
    _, seen = team_run()  # the team's commands ran beside the other tests (below); what they left is checked here
    run, gate, pulled, logged = seen["run"], seen["gate"], seen["pulled"], seen["logged"]
    # two builds at once on the cluster, logging to the PostgreSQL-backed server; a third fails at once (its
    # folder on the node cannot be made) and leaves the others alone, which are gated and reported
    assert run.returncode == 2, run.stderr[-4000:]
    assert "1 of 3 builds failed on Ray: ref-small@fp8: cannot write artifacts" in run.stderr
    assert "ref-small@bf16: 4 stages done" in run.stderr and "ref-small@int8: 4 stages done" in run.stderr
    decided = seen["decided"]
    assert decided["chosen"] == "int8" and [b["precision"] for b in decided["builds"]] == ["int8"], decided["why"]
    assert seen["report"]
    # each build's stages ran on the Ray node, in its own cache; the two chains overlapped in time
    assert seen["stages"] == {p: {"quantize", "evaluate", "bench", "size"} for p in ("bf16", "int8")}
    spans = seen["spans"]
    assert spans["int8"][0] < spans["bf16"][1], spans  # int8 started (quantizing) before the baseline was done
    # the driver has the judged stages it read back from the store, and no checkpoint
    assert seen["driver"] == {"evaluate": True, "quantize": False}

    # another machine, an empty folder, the same server: the same decision
    assert gate.returncode == 0, gate.stderr[-4000:]
    again = last_json_line(gate.stdout)["gate"]
    assert again["chosen"] == decided["chosen"]
    for a, b in zip(again["builds"], decided["builds"], strict=True):
        assert a["verdict"] == b["verdict"] and a["tasks"] == b["tasks"]
    assert again["registered"]["source"].startswith("mlflow-artifacts:/")  # the server's proxied store

    # a deploy job pulls what ships into an empty folder: it loads and is the gated build
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    assert seen["same_logits"]
    assert seen["readme"].startswith("# ref-small int8: the build qeval ships")

    # the database password is in no output, log, param, tag or artifact of qeval's
    assert logged.returncode == 0 and "qeval.precision" in logged.stdout, logged.stderr[-2000:]
    printed = [run.stdout, run.stderr, gate.stdout, gate.stderr, pulled.stdout, pulled.stderr, logged.stdout]
    assert not [t for t in printed if seen["password"] in t]
    assert seen["written"] == []


def _two_builds_on_ray_then_the_gate_from_an_empty_folder_then_pull(team: dict) -> dict:
    """The team's commands one after the other (each needs what the last left in the store), and what each left,
    for the test to check: the run on Ray, a gate from an empty folder, a pull, and the store's params and tags."""
    root = team["root"]
    cards = _card(root / "shared")
    driver, gater, deploy = root / "driver", root / "gater", root / "deploy"

    (team["worker"] / "artifacts/ref-small").mkdir(parents=True)
    (team["worker"] / "artifacts/ref-small/fp8").write_text("not a folder")
    precisions = ("--precision", "int8", "--precision", "fp8")
    run = _qeval(
        team, driver, cards, "run", "--model", "ref-small", *precisions, "--skip", "serve", "--ray", team["ray"]
    )
    (root / "run.log").write_text(run.stderr)  # kept with the test's folder, to read what the user saw
    decision = driver / "artifacts/ref-small/gate.json"
    seen = {
        "run": run,
        "decided": json.loads(decision.read_text()) if decision.is_file() else {"chosen": None, "why": "no gate.json"},
        "report": (driver / "reports/ref-small/report.md").is_file(),
        "driver": {s: (driver / f"artifacts/ref-small/int8/{s}").exists() for s in ("evaluate", "quantize")},
        "stages": {},
        "spans": {},
        "password": team["password"],
    }
    for p in ("bf16", "int8"):
        manifests = [
            json.loads(m.read_text()) for m in (team["worker"] / "artifacts/ref-small" / p).glob("*/manifest.json")
        ]
        seen["stages"][p] = {m["stage"] for m in manifests}
        starts = [time.mktime(time.strptime(m["started"][:19], "%Y-%m-%dT%H:%M:%S")) for m in manifests]
        ends = [s + m["seconds"] for s, m in zip(starts, manifests, strict=True)]
        seen["spans"][p] = (min(starts, default=0), max(ends, default=0))

    seen["gate"] = _qeval(
        team, gater, cards, "gate", "--model", "ref-small", "--precision", "int8", "--json", timeout=300
    )
    seen["pulled"] = _qeval(team, deploy, cards, "pull", "--model", "ref-small", str(deploy / "model"), "--json")
    built = team["worker"] / "artifacts/ref-small/int8/quantize/checkpoint"
    seen["same_logits"] = seen["pulled"].returncode == 0 and same_logits(deploy / "model", built)
    readme = deploy / "model/README.md"
    seen["readme"] = readme.read_text() if readme.is_file() else ""
    dump = [
        str(VENV_BIN / "python"),
        "-c",
        (
            "import json; from mlflow.tracking import MlflowClient; c = MlflowClient('" + team["uri"] + "'); "
            "print(json.dumps([[r.data.params, r.data.tags] for e in c.search_experiments() "
            "for r in c.search_runs([e.experiment_id], run_view_type=3)]))"
        ),
    ]
    seen["logged"] = team["ns"].run(dump)
    seen["written"] = [
        f
        for folder in (team["worker"], driver, gater, deploy, team["store"])
        for f in folder.rglob("*")
        if f.is_file() and team["password"].encode() in f.read_bytes()
    ]
    return seen
