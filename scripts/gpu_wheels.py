"""The wheels scripts/gpu_bench.py needs on a lent GPU machine, with their dependencies, for that machine's Python
(3.12 on x86-64), leaving out what it already has (docs/gpu.md, "A lent GPU: the smoke check").

    .venv/bin/python scripts/gpu_wheels.py      # into .whl/ (git-ignored), with .whl/carried.txt

uv resolves what the smoke check imports (qeval's configs, llm-compressor, lm-eval), at requirements.lock's versions,
against the packages the machine has: the versions its documentation gives are held, and nothing it has is carried.
pip then downloads each wheel that resolution adds; a pure-Python package published only as source is built into a
wheel here. That machine reaches no package index, so a dependency missed here is an ImportError there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / ".whl"
PYTHON = "3.12"
WANTS = ("pydantic", "llmcompressor", "compressed-tensors", "lm-eval", "datasets")
MACHINE_PINS = {
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "triton": "3.6.0",
}
"""The GPU machine's versions that its documentation gives (Python 3.12.3, torch 2.11.0+cu130)."""
_MACHINE_LIST = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama contourpy cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cycler
einops filelock fonttools frozenlist fsspec h11 h5py hf-xet httpcore httpx huggingface-hub idna jinja2 joblib
kiwisolver llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict
networkx ninja numba numpy nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx packaging pandas peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pygments pyparsing python-dateutil pyyaml regex requests rich
sacrebleu safetensors scikit-learn scipy sentencepiece setuptools shellingham six sympy tabulate threadpoolctl
tiktoken tokenizers torch tqdm transformers triton typer typing-extensions urllib3 xxhash yarl zipp"""
MACHINE_HAS = frozenset(_MACHINE_LIST.split())
"""What the GPU machine's image holds (the device's package list), never carried."""
PIP = (sys.executable, "-m", "pip", "--quiet")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def _locked(name: str) -> str:
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#") and canonicalize_name(line.split("==")[0]) == canonicalize_name(name):
            return line.strip()
    raise SystemExit(f"gpu_wheels: requirements.lock pins no {name}")


def carried() -> list[str]:
    """name==version of everything to carry: the wants and their dependencies, less what the machine has."""
    with tempfile.TemporaryDirectory() as tmp:
        request, held = Path(tmp) / "request.in", Path(tmp) / "machine.txt"
        request.write_text("\n".join(_locked(n) for n in WANTS) + "\n")
        held.write_text("\n".join(f"{n}=={v}" for n, v in MACHINE_PINS.items()) + "\n")
        cmd = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-header", "--no-annotate"]
        cmd += ["--python-version", PYTHON, "--python-platform", "x86_64-manylinux_2_28", "-c", str(held)]
        for name in MACHINE_HAS:
            cmd += ["--no-emit-package", name]
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
        done = subprocess.run([*cmd, str(request)], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"gpu_wheels: {done.stderr.strip()[-800:]}")
    pins = []
    for line in done.stdout.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(str(Requirement(line)))
    return pins


def main() -> int:
    pins = carried()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    download = [*PIP, "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON, "--implementation"]
    download += ["cp", *platforms, "-d", str(OUT)]
    for pin in pins:
        got = subprocess.run(
            [*download, pin],
            capture_output=True,
            text=True,
            check=False,
        )
        if got.returncode != 0:  # published as source only: built here (pure Python, so any Python's wheel fits)
            subprocess.run([*PIP, "wheel", "--no-deps", "-w", str(OUT), pin], check=True)
    (OUT / "carried.txt").write_text("\n".join(pins) + "\n")
    size = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"{len(pins)} wheels, {size / 2**20:.1f} MiB in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
