"""`qeval sensitivity`: each layer group's cost when it alone is quantized to one of the card's precisions
(quant/sensitivity.py), on the card's baseline weights and calibration text, most sensitive first, with the
ranking's own check (its most sensitive half against its least). The first part of the mixed-precision
search of issue 43: which layers a build would keep at a larger format."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipelines.core.card.cards import ModelCard
from pipelines.core.framework.weights import resolve_weights
from pipelines.core.system.device import compute_device
from pipelines.core.system.errors import QevalError
from pipelines.stages.quantize import calibration_spec
from quant import calibration
from quant.execution import compute_dtype
from quant.precisions import get_precision
from quant.sensitivity import Sensitivity, halves, layer_groups, rank, weight_args

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranking:
    """A precision's per-group sensitivity on a model, and the halves' check."""

    model: str
    precision: str
    scheme: str  # the precision's weights, as its summary says (4-bit, groups of 128 ...)
    tokens: int  # calibration tokens every KL divergence is averaged over
    ranked: list[Sensitivity]
    top_half_kl: float  # the most sensitive half of the groups quantized at once
    bottom_half_kl: float  # the least sensitive half

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "precision": self.precision,
            "scheme": self.scheme,
            "tokens": self.tokens,
            "ranked": [{"group": s.group.name, "modules": list(s.group.modules), "kl": s.kl} for s in self.ranked],
            "top_half_kl": self.top_half_kl,
            "bottom_half_kl": self.bottom_half_kl,
        }


def measure(card: ModelCard, precision: str, samples: int | None = None) -> Ranking:
    """Rank the card's baseline's layer groups by `precision`'s round-to-nearest cost on its calibration text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    card.require_precision(precision)
    p = get_precision(precision)
    if p.recipe is None or p.shares:
        quantized = [q for q in card.precisions if get_precision(q).recipe and not get_precision(q).shares]
        raise QevalError(f"sensitivity: {precision} quantizes no weights of its own; pick one of {quantized}")
    spec, _ = calibration_spec(card, samples)
    if spec is None:
        raise QevalError(f"sensitivity: {card.name}'s card has no calibration section to measure on; add one")
    base = resolve_weights(card)
    remote = card.source.trust_remote_code
    dtype = getattr(torch, compute_dtype(compute_device().device))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=remote, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=remote)
    try:
        calib = calibration.prepare(
            spec, calibration.read_texts(spec), lambda t: tokenizer.encode(t, add_special_tokens=False)
        )
    except ValueError as e:
        raise QevalError(f"sensitivity: {e}") from None
    batches = [torch.tensor([ids]) for ids in calib.input_ids]
    ignore = card.quantization.ignore
    groups, args = layer_groups(model.eval(), ignore), weight_args(precision, card.quantization.group_size, ignore)

    def said(done: int, total: int) -> None:
        log.info("%s@%s sensitivity: %d of %d layer groups", card.name, precision, done, total)

    ranked = rank(model, groups, args, batches, said)
    top, bottom = halves(model, ranked, args, batches)
    return Ranking(card.name, precision, p.describe(card.quantization.group_size), calib.tokens, ranked, top, bottom)
