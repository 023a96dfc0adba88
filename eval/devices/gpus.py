"""A catalog of data-centre GPUs (vendor data sheets).

Memory is what the device exposes, as nvidia-smi's total reads in MiB (an "80 GB" H100 81,559 MiB: 79.6 GiB;
a "24 GB" L4 23,034 MiB: 22.5 GiB; a "48 GB" L40S 46,068 MiB: 45.0 GiB). Throughput is dense (no sparsity)
tensor-core peak. How a GPU runs a precision (native, weight-only, emulated, or with no kernel) is the kernel
table's row for its compute capability (quant/kernels.py). A device is matched by its whole name as torch reports
it, never by a part of it: "NVIDIA H100 NVL" is not an H100 SXM, "NVIDIA GH200 480GB" not an H200, "NVIDIA L40"
not an L4; a GPU not in the catalog is unknown (no data-sheet bandwidth, no price), not the nearest name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quant.execution import Device, Execution, compute_units, execution, runs
from quant.lookup import lookup

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str  # catalog key
    cuda_names: str  # torch.cuda.get_device_name() without its "NVIDIA " prefix: a regular expression, matched whole
    memory_gib: float
    bandwidth: float  # bytes/s, peak
    bf16_flops: float  # dense tensor peak, FLOP/s
    int8_ops: float
    capability: tuple[int, int]
    fp8_flops: float | None = None  # None: no FP8 tensor cores
    fp4_flops: float | None = None  # None: no FP4 tensor cores

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def device(self) -> Device:
        return Device("cuda", self.capability)

    def execution(self, precision: str) -> Execution:
        """How `precision` runs here: native, weight-only, emulated, or not (no kernel; why_not says why)."""
        return execution(precision, self.device)

    def why_not(self, precision: str) -> str | None:
        """Why no kernel runs `precision` here, or None where one does."""
        row = runs(precision, self.device)
        return None if row is None or row.runs else row.why

    def compute_flops(self, precision: str) -> float:
        """Peak of the units a precision's matrix products use here (weight-only builds compute in 16 bits)."""
        units = compute_units(precision, self.device)
        peak = {"fp4": self.fp4_flops, "fp8": self.fp8_flops, "int8": self.int8_ops}.get(units)
        return peak or self.bf16_flops


T = 1e12
MIB = 2**20 / GIB  # GiB per MiB
CATALOG: list[Gpu] = [
    # HGX B200, per GPU (its data sheet's eight-GPU figures over eight; INT8 dense, half its sparse figure); memory as
    # nvidia-smi reads a B200's total
    Gpu("b200", "B200", 183_359 * MIB, 7.7 * T, 2250 * T, 4500 * T, (10, 0), fp8_flops=4500 * T, fp4_flops=9000 * T),
    Gpu("h200", "H200", 143_771 * MIB, 4.8 * T, 989 * T, 1979 * T, (9, 0), fp8_flops=1979 * T),
    Gpu("h100-pcie", "H100 PCIe", 81_559 * MIB, 2.0 * T, 756 * T, 1513 * T, (9, 0), fp8_flops=1513 * T),
    Gpu("h100-sxm", "H100 80GB HBM3", 81_559 * MIB, 3.35 * T, 989 * T, 1979 * T, (9, 0), fp8_flops=1979 * T),
    Gpu("a100-80gb", "A100-SXM4-80GB", 81_920 * MIB, 2.039 * T, 312 * T, 624 * T, (8, 0)),
    Gpu("a100-80gb-pcie", "A100 80GB PCIe", 81_920 * MIB, 1.935 * T, 312 * T, 624 * T, (8, 0)),
    Gpu("a100-40gb", "A100-SXM4-40GB|A100-PCIE-40GB", 40_960 * MIB, 1.555 * T, 312 * T, 624 * T, (8, 0)),
    Gpu("l40s", "L40S", 46_068 * MIB, 0.864 * T, 362 * T, 733 * T, (8, 9), fp8_flops=733 * T),
    Gpu("l4", "L4", 23_034 * MIB, 0.3 * T, 121 * T, 242 * T, (8, 9), fp8_flops=242 * T),
    Gpu("a10g", "A10G", 23_028 * MIB, 0.6 * T, 70 * T, 140 * T, (8, 6)),
]
BY_NAME = {g.name: g for g in CATALOG}


def get_gpu(name: str) -> Gpu:
    """The catalog entry for `name`; an unknown name lists the known ones."""
    return lookup(BY_NAME, name, "GPU")


def gpu_for_device(device_name: str) -> Gpu | None:
    """The catalog entry of a device named `device_name` by torch ("NVIDIA H100 80GB HBM3"); None where no
    entry names it whole."""
    name = re.sub(r"^NVIDIA\s+", "", device_name.strip(), flags=re.IGNORECASE)
    return next((g for g in CATALOG if re.fullmatch(g.cuda_names, name, flags=re.IGNORECASE)), None)


def device_column(kind: str, device_name: str | None) -> str:
    """A device as the capacity tables name it: "cpu", a GPU's catalog name where the catalog knows it (its
    price and its projection are keyed so), else torch's name for it."""
    if kind == "cpu":
        return "cpu"
    gpu = gpu_for_device(device_name) if device_name else None
    return gpu.name if gpu else (device_name or "an unnamed GPU")


def peak_bandwidth(device_name: str) -> float | None:
    """Peak bandwidth in bytes/s for a CUDA device name, or None when unknown."""
    g = gpu_for_device(device_name)
    return g.bandwidth if g else None
