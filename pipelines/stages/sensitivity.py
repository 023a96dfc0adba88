"""The sensitivity stage: a precision's layer groups ranked by what quantizing each alone costs, and the frontier
of mixed builds it predicts (issue 43's search reads both; quant/sensitivity.py measures them).

On the card's baseline weights and calibration text: each format-sharing layer group alone quantized to the
precision's weight scheme, round to nearest, its mean KL divergence from the baseline's next-token distribution;
the ranking's own check (its most sensitive half quantized at once against its least); then, for every number k
of the most sensitive groups kept at the fallback precision, the divergence of that mix and its projected
weight bytes. Kept in the precision's build folder (artifacts/<model>/<precision>/sensitivity/) and logged to its
MLflow run as a table; the report draws it (`sensitivity.png`, on the summary run and the precision's own).

On a GPU the work runs there, in a child process (CUDA in qeval's own process would hold GPU memory for as long as
it runs); on a CPU in this one. Its memory is bounded before it starts: the baseline's logits for every calibration
sample are held throughout (each variant's are compared a sample at a time), at most LOGITS_SHARE of the device's
memory (`search.samples` and `calibration.max_seq_length` set it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipelines.core.card.cards import ModelCard
from pipelines.core.card.search import fallback_of
from pipelines.core.framework.demands import available_bytes
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import (
    calibration_spec,
    model_config,
    offline_env,
    resolve_weights,
    weights_identity,
)
from pipelines.core.store.layout import STAGE_LOG
from pipelines.core.store.manifests import StageRecord
from pipelines.core.store.results.ranked import Candidate, Ranked, RankedGroup
from pipelines.core.system.child import run_child
from pipelines.core.system.device import compute_device
from pipelines.core.system.errors import QevalError
from quant import calibration
from quant.calibration import CalibrationSpec
from quant.execution import compute_dtype
from quant.precisions import get_precision, mix_name
from quant.sensitivity import baseline_logits, frontier, halves, layer_groups, parameters, rank, weight_args

log = logging.getLogger(__name__)

TABLE = "sensitivity.json"


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
    job = SensitivityJob(
        label=f"{card.name}@{precision}",
        base=base,
        precision=precision,
        fallback=fallback,
        calibration=spec,
        group_size=card.quantization.group_size,
        ignore=card.quantization.ignore,
        trust_remote_code=card.source.trust_remote_code,
        device=compute_device().kind,
        dtype=compute_dtype(compute_device().device),
    )
    check_memory(job, model_config(base), compute_device().memory_bytes or available_bytes())
    return run_stage(tracker, precision, Ranked, inputs, lambda out: _measure_here(card, job, out), force=force)


class SensitivityJob(BaseModel):
    """One ranking's work, for the process that does it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str = Field(description="card@precision, for progress lines")
    base: str = Field(description="the baseline's weights (a local folder)")
    precision: str = Field(description="the precision whose weight scheme each group is quantized to")
    fallback: str = Field(description="what the kept groups are built at")
    calibration: CalibrationSpec
    group_size: int
    ignore: list[str]
    trust_remote_code: bool = False
    device: Literal["cpu", "cuda"] = Field(description="where the model and its logits are held")
    dtype: str = Field(description="the dtype it computes in (quant/execution.py, compute_dtype)")


LOGITS_SHARE = 0.25
"""The most of the device's memory (a GPU's, else what this machine has available) the baseline's logits may take."""


def check_memory(job: SensitivityJob, config: dict, memory: int | None) -> None:
    """QevalError, one line, where the baseline's logits for every calibration sample (at most its token count,
    each a [tokens, vocabulary] row in the compute dtype) would take more than LOGITS_SHARE of `memory`."""
    vocab = config.get("text_config", config).get("vocab_size") or 0
    c = job.calibration
    need = c.num_samples * c.max_seq_length * vocab * (2 if job.dtype in ("bfloat16", "float16") else 4)
    if memory and need > LOGITS_SHARE * memory:
        where = "the GPU's" if job.device == "cuda" else "this machine's available"
        raise QevalError(
            f"sensitivity {job.label}: the baseline's logits for {c.num_samples:,} samples of up to "
            f"{c.max_seq_length:,} tokens take up to {need / 1e9:.1f} GB, more than {LOGITS_SHARE:.0%} of {where} "
            f"{memory / 1e9:.0f} GB; lower search.samples (or calibration.max_seq_length)"
        )


def _measure_here(card: ModelCard, job: SensitivityJob, out: Path) -> Ranked:
    """The ranking on this machine's device: on a GPU in a child process, on a CPU in this one."""
    if job.device == "cuda":
        return run_child(measure, job, out, out / STAGE_LOG, offline_env(card))
    return measure(job, out)


def measure(job: SensitivityJob, out: Path) -> Ranked:
    """Rank the groups, check the ranking and predict the frontier (the module's docstring); the table and chart
    to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    remote, precision, fallback = job.trust_remote_code, job.precision, job.fallback
    model = AutoModelForCausalLM.from_pretrained(
        job.base, dtype=getattr(torch, job.dtype), trust_remote_code=remote, use_safetensors=True
    ).to(job.device)
    tokenizer = AutoTokenizer.from_pretrained(job.base, trust_remote_code=remote)
    spec = job.calibration
    try:
        calib = calibration.prepare(
            spec, calibration.read_texts(spec), lambda t: tokenizer.encode(t, add_special_tokens=False)
        )
    except ValueError as e:
        raise QevalError(f"sensitivity: {e}") from None
    batches = [torch.tensor([ids], device=job.device) for ids in calib.input_ids]
    group_size = job.group_size
    groups, args = layer_groups(model.eval(), job.ignore), weight_args(precision, group_size, job.ignore)
    if not groups:  # nothing to rank, and no mix to make: not a ranking
        raise QevalError(
            f"sensitivity: the card's quantization.ignore ({len(job.ignore)} patterns) leaves none of the model's "
            "layers to quantize, so there is no layer group to rank; ignore fewer layers"
        )
    back = weight_args(fallback, group_size, job.ignore) if get_precision(fallback).recipe else None

    def said(done: int, total: int) -> None:
        log.info("%s sensitivity: %d of %d layer groups", job.label, done, total)

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
