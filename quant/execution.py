"""How a build's matrix products run on a device: natively, weight-only, or emulated. One enum, one function.

Every figure qeval reports says which: the engine bench, the server sweep, sizing's projection per GPU,
the gate's reasons, the report and its charts all take it from `execution()`, a function of the
precision (its registry entry, quant/precisions.py), the device, and the kernel the engine reported
choosing where it reported one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Literal

from quant.precisions import Precision, get_precision


class Execution(StrEnum):
    """How the figures of a build ran."""

    NATIVE = "native"  # the format's own units: FP8 or INT8 tensor cores, a CPU's int8 GEMM, the baseline's 16 bits
    WEIGHT_ONLY = "weight-only"  # low-bit weights upcast inside the kernel, 16-bit compute (Marlin, CPU WNA16)
    EMULATED = "emulated"  # dequantized to a wider type before the product: speed says nothing of the format
    MIXED = "mixed"  # a build whose layers ran in more than one of the above
    UNKNOWN = "unknown"  # a server qeval did not start, or an engine that reported no kernel for a quantized build


DEQUANTIZED = "dequantized"
"""The kernel of an engine that dequantizes every quantized weight to compute (transformers, on any device)."""


@dataclass(frozen=True)
class Device:
    """What runs the products: a CPU, or a CUDA GPU of a compute capability (None: not known)."""

    kind: Literal["cpu", "cuda"]
    capability: tuple[int, int] | None = None


CPU = Device("cpu")


def execution(precision: str, device: Device, kernel: str | None = None) -> Execution:
    """How `precision` runs on `device`, given the kernel the engine chose for its quantized layers.

    - The unquantized baseline runs natively in its own dtype.
    - An engine that dequantizes (`DEQUANTIZED`) emulates every quantized format.
    - vLLM on a CPU: its `CPU...` kernels (oneDNN int8 GEMM, 4-bit weight-only GEMM) run the format
      natively; its `Torch...FP8ScaledMM` kernels call `torch._scaled_mm`, which a CPU without AMX-FP8
      emulates (docs/toolchain.md, "vLLM on a CPU").
    - On CUDA, a Marlin kernel upcasts low-bit weights inside the kernel (weight-only); otherwise the
      precision's registry entry decides by compute capability (FP8 native from 8.9, INT8 from 7.5).
    """
    p = get_precision(precision)
    if p.checkpoint_format is None:
        return Execution.NATIVE
    if kernel == DEQUANTIZED:
        return Execution.EMULATED
    if device.kind == "cpu":
        if kernel is None:
            return Execution.UNKNOWN
        if "FP8" in kernel.upper() and not kernel.startswith("CPU"):
            return Execution.EMULATED
        if p.mix is not None:  # each of its kernels runs one of its two formats: the kernel says which
            return Execution.WEIGHT_ONLY if "WNA16" in kernel.upper() else Execution.NATIVE
        return Execution.WEIGHT_ONLY if p.activation_bits >= 16 else Execution.NATIVE
    if kernel is not None and "marlin" in kernel.lower():
        return Execution.WEIGHT_ONLY
    if device.capability is None:
        return Execution.UNKNOWN
    return _by_capability(p, device.capability)


def _by_capability(p: Precision, capability: tuple[int, int]) -> Execution:
    """The registry's rule: native from `native_from`, weight-only from `weight_only_from`, else emulated."""
    if p.native_from is not None and capability >= p.native_from:
        return Execution.NATIVE
    if p.weight_only_from is not None and capability >= p.weight_only_from:
        return Execution.WEIGHT_ONLY
    return Execution.EMULATED


BF16_UNITS = {"avx512_bf16", "amx_bf16", "bf16"}
"""CPU flags of bf16 matrix units, as /proc/cpuinfo names them: x86's AVX512-BF16 and AMX-BF16, Arm's FEAT_BF16."""


@cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags (x86 `flags`, Arm `Features`); empty where the file cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def compute_dtype(device: Device, flags: frozenset[str] | None = None) -> str:
    """The dtype transformers computes a build in on `device` (calibration, the logit check, evaluation).

    bfloat16 on a GPU and on a CPU with bf16 units; float32 on any other CPU, where torch emulates bf16
    matrix products, slower than float32 (docs/toolchain.md, "transformers", has the figures).
    The weights are the checkpoint's either way: bf16 values and dequantized low-bit ones are exact in
    float32; only the sums are rounded less.
    """
    if device.kind == "cuda":
        return "bfloat16"
    return "bfloat16" if (cpu_flags() if flags is None else flags) & BF16_UNITS else "float32"


def compute_units(precision: str, device: Device) -> str:
    """The units its matrix products use there: its own (fp8, int8) where it runs natively, else bf16."""
    p = get_precision(precision)
    return p.compute if execution(precision, device) == Execution.NATIVE else "bf16"


def combined(executions: list[Execution]) -> Execution:
    """One label for a build whose layers ran in several ways: the one they share, else mixed."""
    distinct = set(executions)
    if not distinct:
        return Execution.UNKNOWN
    return distinct.pop() if len(distinct) == 1 else Execution.MIXED
