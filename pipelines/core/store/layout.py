"""The on-disk layout of a model's artifacts (under pipelines/core/system/paths.py's artifacts_dir()):

artifacts/<model>/<precision>/<stage>/manifest.json   how the stage ran, and its typed result
artifacts/<model>/<precision>/<stage>/stage.log       qeval's lines and its children's output
artifacts/<model>/<precision>/quantize/checkpoint/    a quantized build's weights
artifacts/<model>/gate.json                           the gate's decision
artifacts/<model>/ship-v<N>/evaluate/                 the shipped version's evaluation (gate --against ship)
"""

from __future__ import annotations

from pathlib import Path

from pipelines.core.system.paths import artifacts_dir
from quant.build import CHECKPOINT_DIR

MANIFEST = "manifest.json"
STAGE_LOG = "stage.log"
__all__ = ["CHECKPOINT_DIR", "MANIFEST", "STAGE_LOG", "build_dir", "gate_file", "ship_dir", "stage_dir"]


def build_dir(model: str, precision: str) -> Path:
    return artifacts_dir() / model / precision


def stage_dir(model: str, precision: str, stage: str) -> Path:
    return build_dir(model, precision) / stage


def gate_file(model: str) -> Path:
    return artifacts_dir() / model / "gate.json"


def ship_dir(model: str, version: str) -> Path:
    """Where the registry's shipped version `version` of `model` is read back to (its evaluation)."""
    return artifacts_dir() / model / f"ship-v{version}"
