"""How a build's matrix products run on a device: natively, weight-only, emulated, or not at all.

Every figure qeval reports says which: the engine bench, the server sweep, sizing's projection per GPU,
the gate's reasons, the report and its charts all take it from `execution()`, a function of the
precision (its registry entry, quant/precisions.py, names its format), the device (its row of the kernel
table, quant/kernels.py), and the kernel the engine reported choosing where it reported one.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from quant import kernels
from quant.kernels import CPU, Device, Execution, Kernel
from quant.precisions import get_precision

__all__ = ["CPU", "DEQUANTIZED", "Device", "Execution", "Kernel", "execution", "runs", "runs_on"]

DEQUANTIZED = "dequantized"
"""The kernel of an engine that dequantizes every quantized weight to compute (transformers, on any device)."""
BASELINE = Kernel("", Execution.NATIVE, "the checkpoint's own 16-bit weights")


def runs(
    precision: str, device: Device, flags: frozenset[str] | None = None, machine: str | None = None
) -> Kernel | None:
    """The kernel table's row for `precision` on `device` (a CPU's class from `flags`, else this CPU's); None
    where the table has no class for the device."""
    flags = (cpu_flags() if flags is None else flags) if device.kind == "cpu" else frozenset()
    cls = kernels.device_class(device, flags, machine)
    return None if cls is None else runs_on(precision, cls)


def runs_on(precision: str, cls: str) -> Kernel:
    """The kernel table's row for `precision` on device class `cls`: a mixed build's two formats combined."""
    p = get_precision(precision)
    if not p.formats:
        return BASELINE
    return kernels.combine([kernels.lookup(f, cls) for f in p.formats])


def execution(precision: str, device: Device, kernel: str | None = None) -> Execution:
    """How `precision` runs on `device`, given the kernel the engine chose for its quantized layers.

    - The unquantized baseline runs natively in its own dtype.
    - An engine that dequantizes (`DEQUANTIZED`) emulates every quantized format.
    - vLLM on a CPU: as the kernel it reported runs (kernels.CPU_KERNELS; docs/toolchain.md, "vLLM on a CPU"),
      unknown where it reported none or one the table does not know.
    - On CUDA, a Marlin kernel upcasts low-bit weights inside the kernel (weight-only); otherwise the kernel
      table's row for the compute capability (unknown below 8.0).
    """
    p = get_precision(precision)
    if p.checkpoint_format is None:
        return Execution.NATIVE
    if kernel == DEQUANTIZED:
        return Execution.EMULATED
    if device.kind == "cpu":
        return kernels.CPU_KERNELS.get(kernel or "", Execution.UNKNOWN)
    if kernel is not None and "marlin" in kernel.lower():
        return Execution.WEIGHT_ONLY
    row = runs(precision, device)
    return Execution.UNKNOWN if row is None else row.execution


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
    float32; only the sums are rounded less (NVFP4's too: quant/nvfp4_dtype.py).
    """
    if device.kind == "cuda":
        return "bfloat16"
    return "bfloat16" if (cpu_flags() if flags is None else flags) & BF16_UNITS else "float32"


def compute_units(precision: str, device: Device) -> str:
    """The units its matrix products use there: its own (fp4, fp8, int8) where it runs natively, else bf16."""
    p = get_precision(precision)
    return p.compute if execution(precision, device) == Execution.NATIVE else "bf16"


def combined(executions: list[Execution]) -> Execution:
    """One label for a build whose layers ran in several ways: the one they share, else mixed."""
    distinct = set(executions)
    if not distinct:
        return Execution.UNKNOWN
    return distinct.pop() if len(distinct) == 1 else Execution.MIXED
