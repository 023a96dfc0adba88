"""llm-compressor recipes, one builder per quantized precision (quant/precisions.py names each one's).

AutoAWQ and AutoGPTQ are archived upstream; their algorithms live on in llm-compressor (AWQ's
transform adopted from AutoAWQ, GPTQModifier), whose compressed-tensors checkpoints vLLM serves.
llm-compressor is imported inside the builders, so that reading the registry costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_SIZE = 128
"""Input channels per weight scale of the 4-bit builds, where the card's `quantization.group_size` sets none."""
IGNORE = ("lm_head",)
"""Modules every build leaves unquantized, where the card's `quantization.ignore` names none: the output
layer, whose precision the logits of every token depend on."""


@dataclass(frozen=True)
class RecipeOptions:
    """The card's `quantization:` section, as the recipes take it."""

    group_size: int
    ignore: list[str]


def _groups(preset: str, opts: RecipeOptions) -> dict:
    """A compressed-tensors preset scheme with the card's group size."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights is not None and scheme.weights.group_size is not None:
        scheme.weights.group_size = opts.group_size
    return {"group_0": scheme}


def fp8(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(targets=["Linear"], scheme="FP8_DYNAMIC", ignore=opts.ignore)]


def int8(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    # SmoothQuant moves activation outliers into the weights before both are quantized to 8 bits.
    return [
        SmoothQuantModifier(smoothing_strength=0.8),
        GPTQModifier(targets=["Linear"], scheme="W8A8", ignore=opts.ignore),
    ]


def awq(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    return [
        AWQModifier(),
        QuantizationModifier(config_groups=_groups("W4A16_ASYM", opts), ignore=opts.ignore),
    ]


def gptq(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier

    return [GPTQModifier(config_groups=_groups("W4A16", opts), ignore=opts.ignore)]
