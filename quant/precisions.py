"""The precisions qeval knows: one registry, looked up by name with a suggestion for typos.

The llm-compressor recipe builders join each entry with the quantize stage; this table already says
what each precision is, so that model cards can be validated against it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """One build flavour of a model."""

    name: str
    description: str
    weight_bits: int
    activation_bits: int
    needs_calibration: bool
    checkpoint_format: str | None = None
    """compressed-tensors format the saved checkpoint must declare (None: not quantized)."""
    group_size: int | None = None
    """Weights share one scale per this many input channels (None: one per output channel)."""


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision(
        "bf16",
        "baseline, unquantized (fp16 where bf16 is unsupported)",
        weight_bits=16,
        activation_bits=16,
        needs_calibration=False,
    ),
    "fp8": Precision(
        "fp8",
        "FP8 E4M3 weights per channel, dynamic per-token FP8 activations",
        weight_bits=8,
        activation_bits=8,
        needs_calibration=False,
        checkpoint_format="float-quantized",
    ),
    "int8": Precision(
        "int8",
        "INT8 W8A8: SmoothQuant + GPTQ, dynamic per-token INT8 activations",
        weight_bits=8,
        activation_bits=8,
        needs_calibration=True,
        checkpoint_format="int-quantized",
    ),
    "awq": Precision(
        "awq",
        "AWQ 4-bit asymmetric weights, group 128, 16-bit activations",
        weight_bits=4,
        activation_bits=16,
        needs_calibration=True,
        checkpoint_format="pack-quantized",
        group_size=128,
    ),
    "gptq": Precision(
        "gptq",
        "GPTQ 4-bit symmetric weights, group 128, 16-bit activations",
        weight_bits=4,
        activation_bits=16,
        needs_calibration=True,
        checkpoint_format="pack-quantized",
        group_size=128,
    ),
}


def suggest(name: str, known: list[str]) -> str:
    """' (did you mean 'x'?)' for a close match, else ''."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def get_precision(name: str) -> Precision:
    """The registry entry for `name`; a ValueError that lists the known names otherwise."""
    try:
        return PRECISIONS[name]
    except KeyError:
        known = list(PRECISIONS)
        raise ValueError(f"unknown precision '{name}'{suggest(name, known)}; known: {', '.join(known)}") from None
