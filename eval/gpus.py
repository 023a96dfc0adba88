"""A catalog of data-centre GPUs (vendor data sheets).

Memory is the nominal size, which NVIDIA quotes in GiB ("80 GB" H100: nvidia-smi shows 79.6 GiB
usable). Throughput is dense (no sparsity) tensor-core peak. How a GPU runs a precision (native,
weight-only, emulated) follows from its compute capability (quant/execution.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from quant.execution import Device, Execution, compute_units, execution
from quant.registry import lookup

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str  # catalog key
    cuda_name: str  # substring of torch.cuda.get_device_name()
    memory_gib: float
    bandwidth: float  # bytes/s, peak
    bf16_flops: float  # dense tensor peak, FLOP/s
    fp8_flops: float | None  # None: no FP8 tensor cores
    int8_ops: float
    capability: tuple[int, int]

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def device(self) -> Device:
        return Device("cuda", self.capability)

    def execution(self, precision: str) -> Execution:
        """How `precision` runs here: native, weight-only or emulated."""
        return execution(precision, self.device)

    def compute_flops(self, precision: str) -> float:
        """Peak of the units a precision's matrix products use here (weight-only builds compute in 16 bits)."""
        units = compute_units(precision, self.device)
        peak = {"fp8": self.fp8_flops, "int8": self.int8_ops}.get(units)
        return peak or self.bf16_flops


T = 1e12
# Ordered most specific first for matching CUDA names.
CATALOG: list[Gpu] = [
    Gpu("h200", "H200", 141, 4.8 * T, 989 * T, 1979 * T, 1979 * T, (9, 0)),
    Gpu("h100-pcie", "H100 PCIe", 80, 2.0 * T, 756 * T, 1513 * T, 1513 * T, (9, 0)),
    Gpu("h100-sxm", "H100", 80, 3.35 * T, 989 * T, 1979 * T, 1979 * T, (9, 0)),
    Gpu("a100-80gb", "A100-SXM4-80GB", 80, 2.039 * T, 312 * T, None, 624 * T, (8, 0)),
    Gpu("a100-80gb-pcie", "A100 80GB PCIe", 80, 1.935 * T, 312 * T, None, 624 * T, (8, 0)),
    Gpu("a100-40gb", "A100", 40, 1.555 * T, 312 * T, None, 624 * T, (8, 0)),
    Gpu("l40s", "L40S", 48, 0.864 * T, 362 * T, 733 * T, 733 * T, (8, 9)),
    Gpu("l4", "L4", 24, 0.3 * T, 121 * T, 242 * T, 242 * T, (8, 9)),
    Gpu("a10g", "A10G", 24, 0.6 * T, 70 * T, None, 140 * T, (8, 6)),
]
BY_NAME = {g.name: g for g in CATALOG}


def get_gpu(name: str) -> Gpu:
    """The catalog entry for `name`; an unknown name lists the known ones."""
    return lookup(BY_NAME, name, "GPU")


def gpu_for_device(device_name: str) -> Gpu | None:
    """The catalog entry whose CUDA name `device_name` contains, if any."""
    for g in CATALOG:
        if g.cuda_name.lower() in device_name.lower():
            return g
    return None


def peak_bandwidth(device_name: str) -> float | None:
    """Peak bandwidth in bytes/s for a CUDA device name, or None when unknown."""
    g = gpu_for_device(device_name)
    return g.bandwidth if g else None
