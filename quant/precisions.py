"""The precisions qeval knows: one registry entry per precision holds everything about it.

An entry says how the precision is built (its llm-compressor recipe, whether it needs calibration),
what the saved checkpoint must declare (compressed-tensors format, weight bits), how many bytes a
quantized weight takes for a group size, and which formats of the kernel table its layers take. The
quantize stage, the checkpoint proof, sizing and the GPU catalog all read it from here; which kernel runs
it on a device is quant/kernels.py's table, and how is quant/execution.py's. A KV-cache variant (`int8+kv-fp8`,
get_precision) is a precision's entry with another KV-cache dtype: the same checkpoint, served and sized with its
own cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from quant import kernels, recipes
from quant.lookup import lookup


@dataclass(frozen=True)
class Mix:
    """A mixed build's make-up: every linear layer at `target` but the `kept` most sensitive layer groups, which
    are at `fallback` (quant/sensitivity.py ranks the groups; the search names which)."""

    target: str
    fallback: str
    kept: int


@dataclass(frozen=True)
class Precision:
    """One build flavour of a model."""

    name: str
    summary: str
    """What it is; `{group}` stands for the group size of grouped precisions."""
    weight_bits: int
    activation_bits: int
    needs_calibration: bool
    recipe: Callable[[recipes.RecipeOptions], list] | None
    """llm-compressor modifiers that build it (None: the unquantized baseline)."""
    checkpoint_format: str | None = None
    """compressed-tensors format the saved checkpoint must declare (None: not quantized)."""
    grouped: bool = False
    """Weights share one scale per group of input channels (else one per output channel, or per block)."""
    group: int | None = None
    """The group size its format fixes (NVFP4's 16, vLLM's W4A8 kernel's 128); None: the card's."""
    scale_bytes: float = 2
    """Bytes of one group's scale (NVFP4's are FP8)."""
    zero_point: bool = False
    """Asymmetric: a zero point per group besides the scale."""
    formats: tuple[str, ...] = ()
    """The kernel table's formats its layers take (quant/kernels.py; a mixed build's two; none: the baseline)."""
    kv_cache: Literal["auto", "fp8"] = "auto"
    """The KV cache's dtype it is served with (auto: the card's `server.kv_cache_dtype`)."""
    shares: str | None = None
    """A KV-cache variant serves this precision's checkpoint: it builds nothing of its own."""
    mix: Mix | None = None
    """A mixed build: most layers at one precision, the most sensitive groups at another (MIX_FORM)."""

    @property
    def compute(self) -> str:
        """The matrix units its products use where it runs natively (kernels.COMPUTE; a mixed build's fallback's,
        the wider and slower of its two), else 16-bit."""
        return kernels.COMPUTE.get(self.formats[-1], "bf16") if self.formats else "bf16"

    def group_size(self, card_group: int) -> int:
        """The group size its weights take given the card's `quantization.group_size`."""
        return self.group or card_group

    def describe(self, group_size: int) -> str:
        return self.summary.format(group=self.group_size(group_size))

    def bytes_per_weight(self, group_size: int) -> float:
        """Bytes a weight of a quantized linear layer takes, with its share of scales and zero points.

        Per-channel scales (one 16-bit scale per output row), per-block ones (one per 128 x 128 weights) and a
        tensor's global scale are negligible next to its weights.
        """
        group = self.group_size(group_size)
        zero = self.weight_bits / 8 if self.zero_point else 0
        return self.weight_bits / 8 + ((self.scale_bytes + zero) / group if self.grouped else 0.0)


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision(
        "bf16",
        "baseline, unquantized (fp16 where bf16 is unsupported)",
        weight_bits=16,
        activation_bits=16,
        needs_calibration=False,
        recipe=None,
    ),
    "fp8": Precision(
        "fp8",
        "FP8 E4M3 weights per channel, dynamic per-token FP8 activations",
        weight_bits=8,
        activation_bits=8,
        needs_calibration=False,
        recipe=recipes.fp8,
        checkpoint_format="float-quantized",
        formats=("fp8",),
    ),
    "int8": Precision(
        "int8",
        "INT8 W8A8: SmoothQuant + GPTQ, dynamic per-token INT8 activations",
        weight_bits=8,
        activation_bits=8,
        needs_calibration=True,
        recipe=recipes.int8,
        checkpoint_format="int-quantized",
        formats=("int8",),
    ),
    "awq": Precision(
        "awq",
        "AWQ 4-bit asymmetric weights, group {group}, 16-bit activations",
        weight_bits=4,
        activation_bits=16,
        needs_calibration=True,
        recipe=recipes.awq,
        checkpoint_format="pack-quantized",
        grouped=True,
        zero_point=True,
        formats=("w4a16",),
    ),
    "gptq": Precision(
        "gptq",
        "GPTQ 4-bit symmetric weights, group {group}, 16-bit activations",
        weight_bits=4,
        activation_bits=16,
        needs_calibration=True,
        recipe=recipes.gptq,
        checkpoint_format="pack-quantized",
        grouped=True,
        formats=("w4a16",),
    ),
    "fp8-block": Precision(
        "fp8-block",
        "FP8 E4M3 weights in 128x128 blocks, dynamic FP8 activations per group of 128",
        weight_bits=8,
        activation_bits=8,
        needs_calibration=False,
        recipe=recipes.fp8_block,
        checkpoint_format="float-quantized",
        formats=("fp8-block",),
    ),
    "w4a8": Precision(
        "w4a8",
        "INT4 symmetric weights, group {group}, dynamic per-token FP8 activations",
        weight_bits=4,
        activation_bits=8,
        needs_calibration=False,
        recipe=recipes.w4a8,
        checkpoint_format="pack-quantized",
        grouped=True,
        group=128,
        formats=("w4a8",),
    ),
    "nvfp4a16": Precision(
        "nvfp4a16",
        "NVFP4 weights (FP4 E2M1, an FP8 scale per {group}, a global scale), 16-bit activations",
        weight_bits=4,
        activation_bits=16,
        needs_calibration=False,
        recipe=recipes.nvfp4a16,
        checkpoint_format="nvfp4-pack-quantized",
        grouped=True,
        group=16,
        scale_bytes=1,
        formats=("nvfp4a16",),
    ),
    "nvfp4": Precision(
        "nvfp4",
        "NVFP4 weights and activations (FP4 E2M1, an FP8 scale per {group}, calibrated global scales)",
        weight_bits=4,
        activation_bits=4,
        needs_calibration=True,
        recipe=recipes.nvfp4,
        checkpoint_format="nvfp4-pack-quantized",
        grouped=True,
        group=16,
        scale_bytes=1,
        formats=("nvfp4",),
    ),
}


KV_VARIANTS = {"kv-fp8": "fp8"}
"""`<precision>+<suffix>`: that precision's checkpoint served with this KV-cache dtype (vLLM's
`--kv-cache-dtype`): its own build, evaluated, served, sized and gated like any other."""


MIX_FORM = re.compile(r"(?P<target>[a-z0-9]+)\+(?P<kept>[0-9]+)x(?P<fallback>[a-z0-9]+)")
"""`gptq+3xint8`: GPTQ's build with its 3 most sensitive layer groups at INT8 (a mixed build, Mix)."""
MIX_TARGETS = ("fp8", "int8", "gptq", "nvfp4")
"""Precisions a mixed build can take most layers to: each is one quantizing modifier that applies every config
group's own scheme (AWQ's smoothing searches one scheme's scales across all layers, so it stays uniform)."""


def mix_name(target: str, kept: int, fallback: str) -> str:
    return f"{target}+{kept}x{fallback}"


def get_precision(name: str) -> Precision:
    """The registry entry for `name` (`int8`, a KV-cache variant such as `int8+kv-fp8`, or a mixed build such as
    `gptq+3xint8`); a ValueError that lists the known names otherwise."""
    if m := MIX_FORM.fullmatch(name):
        return _mixed(name, m["target"], m["fallback"], int(m["kept"]))
    base, plus, suffix = name.partition("+")
    p = lookup(PRECISIONS, base, "precision")
    if not plus:
        return p
    kv = lookup(KV_VARIANTS, suffix, f"KV-cache variant of '{base}'")
    return replace(
        p, name=name, summary=f"{p.summary}; {kv.upper()} KV cache", needs_calibration=False, kv_cache=kv, shares=base
    )


def _mixed(name: str, target: str, fallback: str, kept: int) -> Precision:
    t = lookup(PRECISIONS, target, "precision")
    f = lookup(PRECISIONS, fallback, "precision")
    if kept < 1:
        raise ValueError(f"{name}: a mixed build keeps at least one layer group at {fallback} (0: {target} itself)")
    if target not in MIX_TARGETS:
        raise ValueError(f"a mixed build's layers go to one of {', '.join(MIX_TARGETS)}, not '{target}'")
    if f.weight_bits <= t.weight_bits:
        raise ValueError(f"{name}: the layers kept back go to a wider format than {target}'s, not {fallback}")
    stored = {t.checkpoint_format, f.checkpoint_format} - {None}
    return replace(
        t,
        name=name,
        summary=f"{t.summary}; its {kept} most sensitive layer groups at {fallback}",
        needs_calibration=t.needs_calibration or f.needs_calibration,
        recipe=lambda opts: recipes.mixed(t.recipe, f.recipe, opts),
        checkpoint_format="mixed-precision" if len(stored) > 1 else t.checkpoint_format,
        formats=tuple(dict.fromkeys(t.formats + f.formats)),
        mix=Mix(target, fallback, kept),
    )


def variants_problem(names: list[str], baseline: str, served_kv: str) -> str | None:
    """What is wrong with the KV-cache variants among a card's builds (every name is looked up), or None."""
    for i, name in enumerate(names):
        shared = get_precision(name).shares
        if shared and (shared not in names[:i] or name == baseline or served_kv != "auto"):
            return (
                f"precisions: {name} serves {shared}'s checkpoint with its own KV cache: list {shared} before "
                f"it, not as gate.baseline, with server.kv_cache_dtype auto"
            )
    return None


def kv_cache_dtype(precision: str, served: str) -> str:
    """The KV cache's dtype a build is served with: its variant's, else `served` (the card's)."""
    kv = get_precision(precision).kv_cache
    return served if kv == "auto" else kv


def build_recipe(precision: str, opts: recipes.RecipeOptions) -> list | None:
    """The llm-compressor modifiers that build `precision`; None for the unquantized baseline."""
    recipe = get_precision(precision).recipe
    return recipe(opts) if recipe else None
