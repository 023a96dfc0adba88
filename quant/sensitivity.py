"""How much quantizing each layer alone costs: the proxy a mixed-precision search orders layers by (issue 43).

Layers are taken in the groups that must share a format: vLLM fuses a decoder layer's q, k and v projections
into one matrix, and its gate and up projections into another, so each such set is one group; the output and
down projections are groups of one. For each group, its weights alone are fake-quantized with the target
precision's weight scheme, round to nearest (compressed-tensors' own quantize-dequantize, as llm-compressor
resolves the scheme from the precision's recipe: quant/recipes.py), and the model's next-token distribution
on the calibration tokens is held against the baseline's: the mean KL divergence per token, in nats. One
forward pass per group, no gradient: NVIDIA Model Optimizer's AutoQuantize offers the same forward-only score
beside its gradient one. Round to nearest is the proxy, not the build: GPTQ and AWQ then lower each layer's
error, in an order this ranking does not predict exactly; the search judges every candidate by the gate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections vLLM fuses into one matrix, per parent module: one format for all of them."""


@dataclass(frozen=True)
class Group:
    """Linear layers that take one format: a name for the set and the modules' full names."""

    name: str
    modules: tuple[str, ...]


@dataclass(frozen=True)
class Sensitivity:
    """A group's cost when it alone is quantized: mean KL divergence per token from the baseline (nats)."""

    group: Group
    kl: float


def layer_groups(model: Any, ignore: list[str]) -> list[Group]:
    """The model's linear layers in format-sharing groups, in module order; a layer named in `ignore` (a
    name or `re:` pattern, as the card's `quantization.ignore`) is left out, as every build leaves it."""
    import torch

    def ignored(name: str) -> bool:
        return any(re.fullmatch(i[3:], name) if i.startswith("re:") else name.split(".")[-1] == i for i in ignore)

    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not ignored(n)]
    groups, taken = [], set()
    for name in linears:
        if name in taken:
            continue
        parent, _, leaf = name.rpartition(".")
        fused = next((f for f in FUSED if leaf in f), (leaf,))
        members = tuple(
            f"{parent}.{m}" if parent else m for m in fused if (f"{parent}.{m}" if parent else m) in linears
        )
        taken.update(members)
        label = "+".join(m.rpartition(".")[2] for m in members)
        groups.append(Group(f"{parent}.{label}" if parent else label, members))
    return groups


def weight_args(precision: str, group_size: int, ignore: list[str]) -> Any:
    """The compressed-tensors weight arguments of `precision`'s scheme, as its recipe resolves them."""
    from compressed_tensors.quantization import QuantizationArgs

    from quant.precisions import get_precision
    from quant.recipes import RecipeOptions, import_quietly, saved_config

    p = get_precision(precision)
    if p.recipe is None:
        raise ValueError(f"'{precision}' is not a quantized precision")
    import_quietly()
    config = saved_config(p.recipe(RecipeOptions(group_size=group_size, ignore=ignore)), p.checkpoint_format)
    (group,) = config["config_groups"].values()
    return QuantizationArgs(**group["weights"])


def fake_quantized(weight: Any, args: Any) -> Any:
    """`weight` quantized to `args` and back (round to nearest), in its own dtype."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = weight.detach().float()
    if args.group_size:
        grouped = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
    else:  # one scale per output channel (FP8's and INT8's weights)
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(lo, hi, args)
    with torch.no_grad():
        return fake_quantize(w, scale, zero_point, args).to(weight.dtype)


def mean_kl(base_logits: list[Any], logits: list[Any]) -> float:
    """KL(base || other) of the next-token distributions, averaged over every position of every batch, in nats."""
    import torch

    total, positions = 0.0, 0
    for a, b in zip(base_logits, logits, strict=True):
        p = torch.log_softmax(a.float(), dim=-1)
        q = torch.log_softmax(b.float(), dim=-1)
        total += float((p.exp() * (p - q)).sum())
        positions += p.numel() // p.shape[-1]
    return total / positions


def _logits(model: Any, batches: list[Any]) -> list[Any]:
    import torch

    with torch.no_grad():
        return [model(input_ids=b).logits for b in batches]


def quantized_kl(model: Any, groups: list[Group], args: Any, batches: list[Any], base: list[Any]) -> float:
    """The mean KL divergence from `base` (the baseline's logits, per batch) with every group in `groups`
    quantized at once; the model's weights are put back after."""
    return _kl_with(model, [(groups, args)], batches, base)


def _kl_with(model: Any, plan: list[tuple[list[Group], Any]], batches: list[Any], base: list[Any]) -> float:
    """The mean KL divergence from `base` with each plan entry's groups quantized to its arguments."""
    modules = dict(model.named_modules())
    kept = {}
    try:
        for groups, args in plan:
            for name in (n for g in groups for n in g.modules):
                w = modules[name].weight
                kept[name] = w.data
                w.data = fake_quantized(w.data, args)
        # a sample's logits at a time: only the baseline's are held (pipelines/stages/sensitivity.py bounds them)
        return mean_kl(base, (_logits(model, [b])[0] for b in batches))
    finally:
        for name, data in kept.items():
            modules[name].weight.data = data


def baseline_logits(model: Any, batches: list[Any]) -> list[Any]:
    """The unquantized model's logits per batch: what rank, halves and frontier hold every variant against
    (computed once by a caller that runs all three)."""
    return _logits(model, batches)


def rank(
    model: Any, groups: list[Group], args: Any, batches: list[Any], progress=None, base: list[Any] | None = None
) -> list[Sensitivity]:
    """Each group's KL divergence when it alone is quantized, most sensitive first. `batches`: token-id
    tensors of the calibration text; `progress(done, total)` after each group."""
    base = base if base is not None else _logits(model, batches)
    out = []
    for i, g in enumerate(groups):
        out.append(Sensitivity(g, quantized_kl(model, [g], args, batches, base)))
        if progress:
            progress(i + 1, len(groups))
    return sorted(out, key=lambda s: -s.kl)


def halves(
    model: Any, ranked: list[Sensitivity], args: Any, batches: list[Any], base: list[Any] | None = None
) -> tuple[float, float]:
    """The ranking's own check: the KL divergence with the most sensitive half of the groups quantized, and with
    the least sensitive half; a ranking worth searching by has the first well above the second."""
    base = base if base is not None else _logits(model, batches)
    half = len(ranked) // 2
    top, bottom = [s.group for s in ranked[:half]], [s.group for s in ranked[len(ranked) - half :]]
    return quantized_kl(model, top, args, batches, base), quantized_kl(model, bottom, args, batches, base)


def frontier(
    model: Any,
    ranked: list[Sensitivity],
    target: Any,
    fallback: Any,
    batches: list[Any],
    kept: list[int],
    base: list[Any] | None = None,
) -> dict[int, float]:
    """The predicted frontier of mixed builds: for each k in `kept`, the KL divergence with the k most sensitive
    groups at `fallback` (None: left at the baseline's weights) and every other ranked group at `target`."""
    base = base if base is not None else _logits(model, batches)
    out = {}
    for k in kept:
        top, rest = [s.group for s in ranked[:k]], [s.group for s in ranked[k:]]
        out[k] = _kl_with(model, [(rest, target)] + ([(top, fallback)] if fallback is not None else []), batches, base)
    return out


def parameters(model: Any, group: Group) -> int:
    """The weights of a group's layers."""
    modules = dict(model.named_modules())
    return sum(modules[n].weight.numel() for n in group.modules)
