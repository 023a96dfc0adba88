"""What the NVIDIA driver says, through `nvidia-smi`, without CUDA in qeval's own process: whether it is new enough
for the CUDA torch was built with, and how much of the GPU's memory is in use (a stopped vLLM's memory comes back
some time after its processes are gone, and the next vLLM refuses to start beside it).

    python -m pipelines.core.system.nvidia FALLBACK    # the Makefile's word when torch cannot use the GPU (main)

Standard library only (and torch, for main): the Makefile runs it before qeval's own requirements are installed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from shutil import which

from pipelines.core.system.errors import QevalError

MIN_DRIVER = {13: 580, 12: 525}
"""The oldest driver series (Linux) that runs a CUDA major release: NVIDIA's CUDA Toolkit release notes, "CUDA Toolkit
and Corresponding Driver Versions" (minor version compatibility)."""
BACK_SLACK_BYTES = 1 << 30  # what another process may take meanwhile: memory counts as back within it
BACK_TIMEOUT_S = 120.0


def _query(field: str) -> list[str]:
    """`nvidia-smi --query-gpu=FIELD`, a line per GPU; empty where it cannot be asked."""
    if not which("nvidia-smi"):
        return []
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def driver_version() -> str | None:
    found = _query("driver_version")
    return found[0] if found else None


def driver_too_old(cuda: str | None, driver: str | None) -> str | None:
    """One line where a driver `driver` cannot run torch built for CUDA `cuda`, else None."""
    if not cuda or not driver:
        return None
    try:
        need, have = MIN_DRIVER.get(int(cuda.split(".")[0])), int(driver.split(".")[0])
    except ValueError:
        return None
    if need is None or have >= need:
        return None
    return (
        f"this machine's NVIDIA driver {driver} is too old for torch built with CUDA {cuda}, which needs the R{need} "
        f"series or newer: update the driver (torch is not at fault; docs/gpu.md)"
    )


def memory_used() -> int | None:
    """Bytes in use on GPU 0, or None where nvidia-smi cannot say."""
    found = _query("memory.used")
    try:
        return int(found[0]) * 2**20 if found else None
    except ValueError:
        return None


def wait_memory_back(before: int | None, what: str, timeout: float = BACK_TIMEOUT_S, poll: float = 0.5) -> None:
    """Return once GPU 0 uses no more than `before` (what it used before `what` started) and some slack; a
    QevalError, one line, where it does not within `timeout`. Nothing to wait for where nvidia-smi cannot say."""
    if before is None:
        return
    deadline = time.monotonic() + timeout
    while (used := memory_used()) is not None and used > before + BACK_SLACK_BYTES:
        if time.monotonic() > deadline:
            raise QevalError(
                f"GPU 0 still holds {used / 2**30:.1f} GiB {timeout:.0f} s after {what} stopped ({before / 2**30:.1f} "
                f"GiB before it started): another vLLM would not start beside it; see nvidia-smi for what holds it"
            )
        time.sleep(poll)


@contextmanager
def memory_back_after(what: str, on_gpu: bool = True) -> Iterator[None]:
    """Around a vLLM's life on GPU 0 (`on_gpu`): once it ended well, wait until the memory it took is back
    (wait_memory_back). Not after a failure, whose error is the one to see."""
    before = memory_used() if on_gpu else None
    yield
    wait_memory_back(before, what)


def main() -> int:
    """The Makefile's word after torch failed its check: the driver's line where it is too old for this torch's
    CUDA, else the fallback it is given; exit 2."""
    import torch

    said = driver_too_old(torch.version.cuda, driver_version())
    print(said or (sys.argv[1] if len(sys.argv) > 1 else "torch cannot use the GPU here"), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
