"""The sensitivity stage: a precision's layer groups ranked by what quantizing each alone costs, and the frontier
of mixed builds it predicts (issue 43's search reads both; quant/sensitivity.py measures them).

On the card's baseline weights and calibration text: each format-sharing layer group alone quantized to the
precision's weight scheme, round to nearest, its mean KL divergence from the baseline's next-token distribution;
the ranking's own check (its most sensitive half quantized at once against its least); then, for every number k
of the most sensitive groups kept at the fallback precision, the divergence of that mix and its projected
weight bytes. Kept in the precision's build folder (artifacts/<model>/<precision>/sensitivity/), logged to its
MLflow run as a table and a chart.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipelines.core.card.cards import ModelCard
from pipelines.core.card.search import fallback_of
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import calibration_spec, resolve_weights, weights_identity
from pipelines.core.store.manifests import StageRecord
from pipelines.core.store.ranked import Candidate, Ranked, RankedGroup
from pipelines.core.system.device import compute_device
from pipelines.core.system.errors import QevalError
from pipelines.present import charts, search_section
from quant import calibration
from quant.execution import compute_dtype
from quant.precisions import get_precision, mix_name
from quant.sensitivity import baseline_logits, frontier, halves, layer_groups, parameters, rank, weight_args

log = logging.getLogger(__name__)

TABLE = "sensitivity.json"
CHART = "sensitivity.png"


def sensitivity(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, samples: int | None = None
) -> StageRecord[Ranked]:
    """Rank `precision`'s layer groups of the card's model and predict its mixed builds' frontier."""
    card.require_precision(precision)
    p = get_precision(precision)
    if p.recipe is None or p.shares or p.mix:
        quantized = [q for q in card.precisions if (e := get_precision(q)).recipe and not e.shares and not e.mix]
        raise QevalError(f"sensitivity: {precision} quantizes no weights of its own; pick one of {quantized}")
    samples = samples or (card.search.samples if card.search else None)
    spec, calib_id = calibration_spec(card, samples)
    if spec is None:
        raise QevalError(f"sensitivity: {card.name}'s card has no calibration section to measure on; add one")
    fallback = fallback_of(card, precision)
    base = resolve_weights(card)
    inputs = {
        "base": weights_identity(card, base),
        "fallback": fallback,
        "group_size": card.quantization.group_size,
        "ignore": card.quantization.ignore,
        "calibration": {**spec.__dict__, "dataset": calib_id},
    }
    return run_stage(
        tracker,
        precision,
        Ranked,
        inputs,
        lambda out: _measure(card, precision, fallback, base, spec, out),
        force=force,
    )


def _measure(card: ModelCard, precision: str, fallback: str, base: str, spec, out: Path) -> Ranked:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    q, group_size = card.quantization, card.quantization.group_size
    groups, args = layer_groups(model.eval(), q.ignore), weight_args(precision, group_size, q.ignore)
    back = weight_args(fallback, group_size, q.ignore) if get_precision(fallback).recipe else None

    def said(done: int, total: int) -> None:
        log.info("%s@%s sensitivity: %d of %d layer groups", card.name, precision, done, total)

    base = baseline_logits(model, batches)  # once, for the ranking, its check and the frontier
    ranked = rank(model, groups, args, batches, said, base)
    top, bottom = halves(model, ranked, args, batches, base)
    predicted = frontier(model, ranked, args, back, batches, list(range(len(ranked) + 1)), base)
    sizes = [parameters(model, s.group) for s in ranked]
    every = sum(t.numel() for t in model.state_dict().values())
    per_weight = {n: get_precision(n).bytes_per_weight(group_size) for n in (precision, fallback)}
    rows = [
        RankedGroup(group=s.group.name, modules=list(s.group.modules), parameters=n, kl=s.kl)
        for s, n in zip(ranked, sizes, strict=True)
    ]
    result = Ranked(
        precision=precision,
        fallback=fallback,
        scheme=get_precision(precision).describe(group_size),
        tokens=calib.tokens,
        ranked=rows,
        top_half_kl=top,
        bottom_half_kl=bottom,
        frontier=[
            _candidate(precision, fallback, k, sizes, every, per_weight, predicted[k]) for k in range(len(ranked) + 1)
        ],
    )
    (out / TABLE).write_text(json.dumps(result.model_dump(mode="json"), indent=1) + "\n")
    fig = search_section.figure(result)
    fig.savefig(out / CHART, dpi=110)
    charts.close([fig])
    return result


def _candidate(
    precision: str, fallback: str, k: int, sizes: list[int], every: int, per_weight: dict[str, float], kl: float
) -> Candidate:
    """The mix keeping the k most sensitive groups: its name, projected bytes (the layers outside every group at
    16 bits) and bits per quantized weight."""
    kept, rest = sum(sizes[:k]), sum(sizes[k:])
    quantized = kept * per_weight[fallback] + rest * per_weight[precision]
    name = precision if k == 0 else fallback if k == len(sizes) else mix_name(precision, k, fallback)
    return Candidate(
        kept=k,
        precision=name,
        weight_bytes=2 * (every - kept - rest) + quantized,
        effective_bits=8 * quantized / max(kept + rest, 1),
        predicted_kl=kl,
    )
