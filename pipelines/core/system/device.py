"""The device qeval's stages compute on, as torch in this environment sees it.

Asked once per process, of a child Python, and only where an NVIDIA driver is installed; elsewhere it is the
CPU and nothing starts. A child, because `torch.cuda` in qeval's own process would create a CUDA context
there, holding GPU memory beside the servers and children that do the work for as long as qeval runs.
torch's answer, not the driver's: a CPU build of torch in `.venv` on a GPU machine runs every child on the
CPU, and is recorded so (with a warning), not as the GPU it never used. The GPU's name and compute
capability are part of every stage's cache key (pipelines/core/framework/code.py), so an A100's results are not reused
on an H100.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from shutil import which
from typing import Literal

from pipelines.core.system.nvidia import driver_too_old, driver_version
from quant.execution import Device

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 120.0  # importing torch and initialising CUDA, on a cold disk
_PROBE = (
    "import json, torch\n"
    "ok = torch.cuda.is_available()\n"
    "p = torch.cuda.get_device_properties(0) if ok else None\n"
    "print(json.dumps({'cuda': ok, 'count': torch.cuda.device_count() if ok else 0, 'torch': torch.__version__,\n"
    "                  'built_with_cuda': torch.version.cuda, 'name': p.name if p else None,\n"
    "                  'capability': [p.major, p.minor] if p else None, 'memory': p.total_memory if p else None}))\n"
)


@dataclass(frozen=True)
class ComputeDevice:
    """Where the stages run: the CPU, or GPU 0 as torch names it."""

    kind: Literal["cpu", "cuda"]
    name: str | None = None  # torch.cuda.get_device_name(0): "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] | None = None
    memory_bytes: int | None = None  # total memory of GPU 0
    count: int = 0  # GPUs torch sees
    why_cpu: str | None = None  # a GPU is installed and torch here cannot use it

    @property
    def device(self) -> Device:
        return Device(self.kind, self.capability)

    def key(self) -> dict[str, object]:
        """What identifies it in a cache key: the kind, and a GPU's name and compute capability."""
        if self.kind == "cpu":
            return {"device": "cpu"}
        return {"device": "cuda", "gpu": self.name, "capability": list(self.capability or ()), "gpus": self.count}


CPU_DEVICE = ComputeDevice("cpu")


def driver_present() -> bool:
    """An NVIDIA driver seems installed (its /proc folder, a device node, or nvidia-smi, which the Makefile asks;
    containers and sandboxes show some of these and not others), and CUDA_VISIBLE_DEVICES does not hide every
    GPU. A false alarm costs one probe; torch's answer decides."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    return Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidia0").exists() or bool(which("nvidia-smi"))


def probe(python: str = sys.executable) -> dict:
    """torch's own view of CUDA in `python`'s environment (the _PROBE document); raises OSError or
    subprocess.SubprocessError or ValueError where it cannot be had."""
    out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def from_probe(found: dict) -> ComputeDevice:
    """The device a probe's answer describes; the CPU, with the reason, where torch cannot use the GPU."""
    if found.get("cuda"):
        major, minor = found["capability"]
        return ComputeDevice("cuda", found["name"], (int(major), int(minor)), found.get("memory"), found["count"])
    if old := driver_too_old(found.get("built_with_cuda"), driver_version()):
        return ComputeDevice("cpu", why_cpu=old)
    build = "a CPU build" if not found.get("built_with_cuda") else f"built for CUDA {found['built_with_cuda']}"
    return ComputeDevice(
        "cpu", why_cpu=f"an NVIDIA GPU is installed, but torch {found.get('torch')} here is {build} and cannot use it"
    )


@cache
def compute_device() -> ComputeDevice:
    """This machine's device for the stages, asked once per process (see the module's docstring)."""
    if not driver_present():
        return CPU_DEVICE
    try:
        found = from_probe(probe())
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError, TypeError) as e:
        found = ComputeDevice("cpu", why_cpu=f"an NVIDIA GPU is installed, but torch here did not answer ({e})")
    if found.why_cpu:
        log.warning(
            "%s: every stage runs on the CPU; a CUDA build of torch in .venv fixes it (make clean-venv, "
            "then make venv on this machine)",
            found.why_cpu,
        )
    return found
