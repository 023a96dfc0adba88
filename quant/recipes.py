"""llm-compressor recipes, one builder per precision (the table in shared/DESIGN.md).

AutoAWQ and AutoGPTQ are archived upstream; their algorithms live on in llm-compressor (AWQ's
transform adopted from AutoAWQ, GPTQModifier), whose compressed-tensors checkpoints vLLM serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from quant.precisions import get_precision


@dataclass(frozen=True)
class RecipeOptions:
    """The card's overrides (`quantization:` section)."""

    group_size: int = 128
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])


def _groups(preset: str, opts: RecipeOptions) -> dict:
    """A compressed-tensors preset scheme with the card's group size."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights is not None and scheme.weights.group_size is not None:
        scheme.weights.group_size = opts.group_size
    return {"group_0": scheme}


def _fp8(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(targets=["Linear"], scheme="FP8_DYNAMIC", ignore=opts.ignore)]


def _int8(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    # SmoothQuant moves activation outliers into the weights before both are quantized to 8 bits.
    return [
        SmoothQuantModifier(smoothing_strength=0.8),
        GPTQModifier(targets=["Linear"], scheme="W8A8", ignore=opts.ignore),
    ]


def _awq(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    return [
        AWQModifier(),
        QuantizationModifier(config_groups=_groups("W4A16_ASYM", opts), ignore=opts.ignore),
    ]


def _gptq(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier

    return [GPTQModifier(config_groups=_groups("W4A16", opts), ignore=opts.ignore)]


RECIPES: dict[str, Callable[[RecipeOptions], list] | None] = {
    "bf16": None,
    "fp8": _fp8,
    "int8": _int8,
    "awq": _awq,
    "gptq": _gptq,
}


def build_recipe(precision: str, opts: RecipeOptions) -> list | None:
    """The llm-compressor modifiers that build `precision`; None for the unquantized baseline."""
    get_precision(precision)
    builder = RECIPES[precision]
    return builder(opts) if builder else None
