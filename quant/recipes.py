"""llm-compressor recipes, one builder per quantized precision (quant/precisions.py names each one's).

AutoAWQ and AutoGPTQ are archived upstream; their algorithms live on in llm-compressor (AWQ's
transform adopted from AutoAWQ, GPTQModifier), whose compressed-tensors checkpoints vLLM serves.
llm-compressor is imported inside the builders, so that reading the registry costs nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
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
    target_modules: tuple[str, ...] = ()
    """A mixed build's layers at its target precision, by full module name (recipes.mixed)."""
    fallback_modules: tuple[str, ...] = ()
    """A mixed build's layers kept at its fallback precision."""


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


def fp8_block(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(targets=["Linear"], scheme="FP8_BLOCK", ignore=opts.ignore)]


def w4a8(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    # compressed-tensors' W4AFP8 preset: INT4 in groups of 128, the only size vLLM's W4A8 kernel takes
    return [QuantizationModifier(targets=["Linear"], scheme="W4AFP8", ignore=opts.ignore)]


def nvfp4a16(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(targets=["Linear"], scheme="NVFP4A16", ignore=opts.ignore)]


def nvfp4(opts: RecipeOptions) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    # the activations' global scale is calibrated: the recipe needs data
    return [QuantizationModifier(targets=["Linear"], scheme="NVFP4", ignore=opts.ignore)]


def mixed(target: Callable[[RecipeOptions], list], fallback: Callable | None, opts: RecipeOptions) -> list:
    """A mixed build's recipe: the target precision's, its quantizing modifier given two config groups, the
    target's scheme for `opts.target_modules` and the fallback's for `opts.fallback_modules`, each by full module
    name (a fallback of None, the baseline, leaves them unquantized). Exact names, not `Linear`: compressed-tensors
    and vLLM both match a layer to its own name first, and a fused layer (q/k/v) only where all its parts name
    one group (vllm/model_executor/layers/quantization/compressed_tensors/utils.py, `_match_fused_layer`)."""
    if not opts.target_modules:
        raise ValueError("a mixed build names no layers at its target precision")
    steps = target(opts)
    (at,) = [i for i, m in enumerate(steps) if hasattr(m, "resolved_config")]
    groups = {"group_0": _scheme(steps[at], opts.target_modules)}
    ignore = list(opts.ignore)
    if fallback is None:
        ignore += opts.fallback_modules
    elif opts.fallback_modules:
        (back,) = [m for m in fallback(opts) if hasattr(m, "resolved_config")]
        groups["group_1"] = _scheme(back, opts.fallback_modules)
    steps[at] = type(steps[at])(config_groups=groups, ignore=ignore)
    return steps


def _scheme(modifier, modules: tuple[str, ...]):
    """The modifier's one resolved scheme, aimed at `modules`."""
    (scheme,) = modifier.resolved_config.config_groups.values()
    return scheme.model_copy(update={"targets": list(modules)})


def saved_config(recipe: list, fmt: str, group_formats: dict[str, str] | None = None) -> dict:
    """The `quantization_config` a checkpoint that `recipe` builds saves in compressed-tensors format `fmt`,
    resolved from the recipe's quantizing modifier without data (quant/shape_build.py); `group_formats`: each
    config group's own format where they differ (a mixed build's, whose `fmt` is mixed-precision)."""
    from compressed_tensors import __version__
    from compressed_tensors.quantization import QuantizationStatus

    resolving = [m for m in recipe if hasattr(m, "resolved_config")]
    if len(resolving) != 1:
        raise ValueError(f"the recipe has {len(resolving)} quantizing modifiers, not one")
    config = resolving[0].resolved_config.model_copy(deep=True)
    for name, group in config.config_groups.items():
        group.format = (group_formats or {}).get(name, fmt)
    config.format = fmt
    config.quantization_status = QuantizationStatus.COMPRESSED
    # the keys compressed-tensors' compressor adds when it saves a checkpoint (no sparsity, no transform)
    return config.model_dump(mode="json") | {"sparsity_config": {}, "transform_config": {}, "version": __version__}


def import_quietly() -> None:
    """llm-compressor in this process, its logger off: on import it warns that there is no GPU, which is
    true and beside the point where only a recipe's config is read (the quantize stage runs it in a child)."""
    if "llmcompressor" in sys.modules:
        return
    before = os.environ.get("LLM_COMPRESSOR_LOG_DISABLED")
    os.environ["LLM_COMPRESSOR_LOG_DISABLED"] = "true"  # read once, when it configures its logger on import
    try:
        import llmcompressor  # noqa: F401
    finally:
        if before is None:
            del os.environ["LLM_COMPRESSOR_LOG_DISABLED"]
        else:
            os.environ["LLM_COMPRESSOR_LOG_DISABLED"] = before
