"""Shape builds: a model's architecture in a precision's format, without its weights.

A shape build is a folder holding the model's `config.json` with the `quantization_config` the precision's
own llm-compressor recipe (quant/recipes.py) resolves to, saved as its compressed-tensors format declares
(quant/precisions.py), the same config a real build of that precision writes. vLLM's dummy loader
(`--load-format dummy`) builds the model from it with random weights: it creates and processes the
quantized layers and picks its kernels exactly as for a real checkpoint. Speed does not depend on the
weights' values for a dense model whose output length is forced, only on the shape, the format and the
kernels; so every precision can be timed at a real model's shape where its weights cannot be had. What a
shape build measures is a random-weights figure, and is labelled so wherever it is shown.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from quant import recipes
from quant.precisions import build_recipe, get_precision
from quant.recipes import RecipeOptions

# what a tokenizer is made of, copied beside the config where the base folder has one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def quantization_config(precision: str, opts: RecipeOptions) -> dict | None:
    """The `quantization_config` a real build of `precision` saves, resolved from its recipe without data
    (None for the unquantized baseline)."""
    p = get_precision(precision)
    if p.recipe is None or p.checkpoint_format is None:
        return None
    recipes.import_quietly()
    formats = None
    if p.mix:  # recipes.mixed: group_0 the target's layers, group_1 the fallback's
        formats = {"group_0": get_precision(p.mix.target).checkpoint_format}
        if fallback := get_precision(p.mix.fallback).checkpoint_format:
            formats["group_1"] = fallback
    return recipes.saved_config(build_recipe(precision, opts) or [], p.checkpoint_format, formats)


def write_shape_build(
    architecture: Path, precision: str, opts: RecipeOptions, out: Path, tokenizer_from: Path | None = None
) -> Path:
    """`out` holding `architecture` (a config.json) in `precision`'s format, and the tokenizer files of
    `tokenizer_from` where it has them; returns `out`."""
    config = json.loads(architecture.read_text())
    config.pop("quantization_config", None)
    quant = quantization_config(precision, opts)
    if quant is not None:
        config["quantization_config"] = quant
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copy2(tokenizer_from / name, out / name)
    return out


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()
