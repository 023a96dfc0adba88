"""Peak memory bandwidth of common GPUs (vendor data sheets), looked up by the name CUDA reports.

The sizing stage grows this into a full catalog; the engine benchmark needs the bandwidth for MBU.
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name(), bytes per second); most specific names first.
PEAK_BANDWIDTH: list[tuple[str, float]] = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
]


def peak_bandwidth(device_name: str) -> float | None:
    """Peak bandwidth in bytes/s for a CUDA device name, or None when unknown."""
    for key, value in PEAK_BANDWIDTH:
        if key.lower() in device_name.lower():
            return value
    return None
