"""Let llm-compressor's AWQ run on a machine without an accelerator.

llm-compressor 0.14.0.1's AWQ calls `IntermediatesCache.pin_memory()` (modifiers/transform/awq/base.py),
which calls `tensor.pin_memory()`; with no accelerator present that raises "Cannot access accelerator
device when none is available" (docs/toolchain.md). Pinned host memory only speeds up copies to a
device, so where there is no device skipping it changes nothing else. tests/test_quantize.py checks
that the upstream call still fails without the patch, so the patch is dropped once upstream fixes it.
"""

from __future__ import annotations

import torch


def _no_pin(self, batch_index: int, input_names: list[str] | None = None) -> None:
    """Nothing to pin for: there is no accelerator to copy to."""


def skip_pinning_without_accelerator() -> bool:
    """Make IntermediatesCache.pin_memory a no-op when no accelerator exists; True if patched."""
    if torch.accelerator.is_available():
        return False
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = _no_pin
    return True
