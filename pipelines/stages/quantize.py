"""The quantize stage: build a precision's checkpoint, then prove it is real, in fresh processes.

For the baseline precision nothing is built: the stage records the base checkpoint's size, so that
every build has its checkpoint bytes to compare with. A KV-cache variant (`int8+kv-fp8`) builds nothing
either: it records the checkpoint of the precision it serves, once that one is built and checked.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import quant.build as build_mod
import quant.verify as verify
from pipelines.core.card.cards import ModelCard
from pipelines.core.card.search import fallback_of
from pipelines.core.framework.registry import require
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import (
    calibration_spec,
    checkpoint_for,
    offline_env,
    resolve_weights,
    weights_identity,
)
from pipelines.core.store.layout import CHECKPOINT_DIR, STAGE_LOG, stage_dir
from pipelines.core.store.manifests import StageRecord, finished
from pipelines.core.store.results import Quantized
from pipelines.core.store.results.ranked import Ranked
from pipelines.core.system.child import run_child
from pipelines.core.system.device import compute_device
from pipelines.core.system.errors import QevalError
from pipelines.core.system.integrity import file_hashes
from quant.execution import compute_dtype
from quant.precisions import get_precision


def quantize(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, num_samples: int | None = None
) -> StageRecord[Quantized]:
    """Build `precision` of the card's model, check it, and log it to the build's MLflow run."""
    card.require_precision(precision)
    base = resolve_weights(card)
    p = get_precision(precision)
    scheme = p.describe(card.quantization.group_size)
    if p.shares:
        return _shared(card, precision, p.shares, scheme, tracker, force)
    if precision == card.gate.baseline:
        inputs = {"base": weights_identity(card, base)}
        return run_stage(tracker, precision, Quantized, inputs, lambda out: _baseline(card, base, scheme), force=force)
    spec, calib_id = calibration_spec(card, num_samples) if p.needs_calibration else (None, None)
    dtype = compute_dtype(compute_device().device)
    at, kept = _mixed_layers(card, precision) if p.mix else ([], [])
    cfg = build_mod.QuantizeConfig(
        base=base,
        precision=precision,
        group_size=p.group_size(card.quantization.group_size),
        ignore=card.quantization.ignore,
        calibration=spec,
        trust_remote_code=card.source.trust_remote_code,
        target_modules=at,
        fallback_modules=kept,
        dtype=dtype,
    )
    layers = {}
    if p.mix:
        fallback = get_precision(p.mix.fallback).checkpoint_format or "dense"
        layers = {m: get_precision(p.mix.target).checkpoint_format for m in at} | {m: fallback for m in kept}
    # the checkpoint is filled in once it is built (checkpoint and base are paths, not settings)
    check = verify.VerifyConfig(
        base=base,
        checkpoint="",
        precision=precision,
        trust_remote_code=cfg.trust_remote_code,
        dtype=dtype,
        layer_formats=layers,
    )
    inputs = {
        "base": weights_identity(card, base),
        "config": cfg.model_dump(mode="json", exclude={"base", "calibration"}),
        "calibration": {**spec.__dict__, "dataset": calib_id} if spec else None,
        "verify": check.model_dump(mode="json", exclude={"base", "checkpoint"}),
    }
    return run_stage(
        tracker, precision, Quantized, inputs, lambda out: _build(card, cfg, check, scheme, out), force=force
    )


def _mixed_layers(card: ModelCard, precision: str) -> tuple[list[str], list[str]]:
    """A mixed build's layers at its target and at its fallback, from its target's sensitivity ranking."""
    mix = get_precision(precision).mix
    if fallback_of(card, mix.target) != mix.fallback:
        raise QevalError(
            f"{card.name}@{precision}: the card keeps {mix.target}'s sensitive layers at "
            f"{fallback_of(card, mix.target)} (search.fallback), not {mix.fallback}"
        )
    ranked = require(card, mix.target, Ranked, f"{card.name}@{precision}")
    try:
        return ranked.modules(mix.kept)
    except ValueError as e:
        raise QevalError(f"{card.name}@{precision}: {e}") from None


def _shared(
    card: ModelCard, precision: str, shared: str, scheme: str, tracker: Tracker, force: bool
) -> StageRecord[Quantized]:
    """A KV-cache variant's record: the checkpoint of the precision it serves, as that one's stage built it."""
    built = finished(card.name, shared, Quantized)
    if built is None:
        raise QevalError(
            f"{card.name}@{precision} serves {shared}'s checkpoint; build that first: "
            f"qeval quantize --model {card.name} --precision {shared}"
        )
    _, identity = checkpoint_for(card, shared)  # Tampered where its files changed since they were checked
    made = built.result.model_copy(update={"scheme": scheme, "shares": shared})
    return run_stage(tracker, precision, Quantized, {"shares": identity}, lambda out: made, force=force)


def _baseline(card: ModelCard, base: str, scheme: str) -> Quantized:
    return Quantized(
        checkpoint=base,
        checkpoint_bytes=build_mod.weight_bytes(Path(base)),
        scheme=scheme,
        source=card.source.location,
        files=file_hashes(Path(base)),
    )


def _build(
    card: ModelCard, cfg: build_mod.QuantizeConfig, check: verify.VerifyConfig, scheme: str, out: Path
) -> Quantized:
    """Quantize and check the saved checkpoint, in one child process."""
    both = build_mod.BuildConfig(quantize=cfg, verify=check)
    done = run_child(build_mod.build_and_prove, both, out, out / STAGE_LOG, offline_env(card))
    made, proof = done.build, done.proof
    checkpoint = out / CHECKPOINT_DIR
    shutil.copy(checkpoint / "recipe.yaml", out / "recipe.yaml")  # the recipe at the top of the run page too
    final = stage_dir(card.name, cfg.precision, Quantized.STAGE) / CHECKPOINT_DIR  # once in place
    return Quantized(
        checkpoint=str(final),
        checkpoint_bytes=made.checkpoint_bytes,
        scheme=scheme,
        source=card.source.location,
        config=cfg,
        build=made,
        verify=check.model_copy(update={"checkpoint": str(final)}),
        proof=proof,
        files=file_hashes(checkpoint),  # what every later reader checks the checkpoint against
    )
