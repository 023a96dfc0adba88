"""The size stage: will each build fit the card's GPUs, with how many users, and how fast?

Projections come from eval/devices/sizing.py over the model's architecture (`source.config`, else the local
checkpoint's config.json; nothing is downloaded). Weights are the build's real weight files where
its quantize stage has run, else the precision's bytes per weight at the card's group size; KV entries
take the bytes of the KV-cache dtype the build is served with (a KV-cache variant's, else the card's).
The GPUs are the card's target GPUs and those its gate requires a fit on. Where the build was
benchmarked, the projection for the benchmark's own device (its bandwidth, its resident bytes) is set beside
the measured decode speed; where its format was timed at the model's shape (the shape stage), that
measurement's share of its device's ceiling is kept beside the projections, which assume the ceiling.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from pathlib import Path

import eval.devices.gpus as gpus
import eval.devices.sizing as sizing
from eval.devices.speed import decode_step_bytes, mid_generation_context
from pipelines.core.card.cards import ModelCard
from pipelines.core.framework import weights
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.store.manifests import StageRecord, finished, result_of
from pipelines.core.store.results import AtShape, BenchCheck, Benched, Quantized, Sized
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import file_digest
from quant.precisions import kv_cache_dtype

log = logging.getLogger(__name__)


def architecture(card: ModelCard) -> tuple[sizing.Shape, Path]:
    """The model's shape from `source.config` or the local checkpoint's config.json."""
    shape, path, _ = weights.architecture(card, "sizing")
    return shape, path


def assumptions(card: ModelCard, precision: str | None = None, *, mbu: float = 1.0) -> sizing.Assumptions:
    """What a build's projections assume: sizing's defaults, with the KV-cache dtype it is served with (the
    card's where no build is named)."""
    kv = kv_cache_dtype(precision, card.server.kv_cache_dtype) if precision else card.server.kv_cache_dtype
    return sizing.Assumptions(kv_dtype_bytes=sizing.KV_DTYPE_BYTES[kv], mbu=mbu)


def real_weight_bytes(card: ModelCard, precision: str) -> float | None:
    """The build's weight files in bytes, where its quantize stage has run."""
    built = result_of(card.name, precision, Quantized)
    return float(built.checkpoint_bytes) if built else None


def fits_table(
    card: ModelCard,
    precisions: list[str],
    gpu_names: list[str],
    *,
    batch: int,
    input_len: int,
    output_len: int,
    a: sizing.Assumptions,
) -> list[sizing.Fit]:
    """The projection of every precision on every GPU named, at one grid point, each with its own KV-cache
    dtype over `a`; an unknown GPU is one error."""
    try:
        chosen = [gpus.get_gpu(name) for name in gpu_names]
    except ValueError as e:
        raise QevalError(str(e)) from None
    shape, _ = architecture(card)
    grid = {"batch": batch, "input_len": input_len, "output_len": output_len}
    group = card.quantization.group_size
    kv = {p: assumptions(card, p).kv_dtype_bytes for p in precisions}
    return [
        sizing.fit(
            shape,
            p,
            gpu,
            **grid,
            group_size=group,
            weights=real_weight_bytes(card, p),
            a=replace(a, kv_dtype_bytes=kv[p]),
        )
        for p in precisions
        for gpu in chosen
    ]


def bench_check(bench: Benched | None) -> BenchCheck | None:
    """Projected decode ceiling on the benchmark's own device beside the measured speed (batch 1), both
    over the bytes a decode step reads (eval/devices/speed.py)."""
    point = bench.at(1) if bench is not None and not bench.config.no_weights else None
    if point is None or not point.decode_tps_per_user:
        return None
    e = bench.engine
    context = mid_generation_context(bench.input_len, bench.output_len)
    step = decode_step_bytes(e.weight_bytes, e.embedding_bytes, e.kv_bytes_per_token, 1, context)
    ceiling = e.bandwidth_gb_s * 1e9 / step
    measured = point.decode_tps_per_user
    return BenchCheck(decode_ceiling=ceiling, decode_measured=measured, measured_over_ceiling=measured / ceiling)


def projection(
    card: ModelCard,
    precisions: list[str],
    gpu_names: list[str],
    batch: int | None,
    input_len: int | None,
    output_len: int | None,
    mbu: float,
) -> tuple[dict[str, int], sizing.Assumptions, list[sizing.Fit]]:
    """`qeval size`'s table: each precision on each GPU at a grid point (the card's where one is not given),
    the grid point, and what the projection assumed."""
    s = card.speed
    grid = {
        "batch": batch or s.largest_batch,
        "input_len": input_len or s.input_len,
        "output_len": output_len or s.output_len,
    }
    a = assumptions(card, mbu=mbu)
    return grid, a, fits_table(card, precisions, gpu_names, **grid, a=a)


def size(card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False) -> StageRecord[Sized]:
    """Project memory and speed of one build on the card's GPUs and log them."""
    card.require_precision(precision)
    shape, config = architecture(card)
    s, group, a = card.speed, card.quantization.group_size, assumptions(card, precision)
    weights = real_weight_bytes(card, precision)
    bench = finished(card.name, precision, Benched)
    at_shape = finished(card.name, precision, AtShape)
    inputs = {
        "config": file_digest([config]),
        "weights": weights,
        "gpus": card.sizing_gpus,
        "grid": [s.largest_batch, s.input_len, s.output_len],
        "group_size": group,
        "assumptions": asdict(a),
        "bench": [bench.inputs_digest, bench.started] if bench else None,  # a forced rerun counts too
        "shape": [at_shape.inputs_digest, at_shape.started] if at_shape else None,
    }

    def work(out: Path) -> Sized:
        fits = fits_table(
            card,
            [precision],
            card.sizing_gpus,
            batch=s.largest_batch,
            input_len=s.input_len,
            output_len=s.output_len,
            a=a,
        )
        (out / "fits.json").write_text(json.dumps([asdict(f) for f in fits], indent=2) + "\n")
        for f in fits:
            fit = "fits" if f.fits else (f"fits on {f.tensor_parallel} (TP)" if f.tensor_parallel else "does not fit")
            log.debug(
                "%s@%s on %s: %s, %.3g GB at batch %d, %d sequences at most, decode <= %.0f tok/s per user",
                card.name,
                precision,
                f.gpu,
                fit,
                f.total_gb,
                s.largest_batch,
                f.max_sequences,
                f.decode_tps_per_user,
            )
        projected = sizing.weight_bytes(shape, precision, group)
        return Sized(
            batch=s.largest_batch,
            input_len=s.input_len,
            output_len=s.output_len,
            group_size=group,
            weights_bytes=weights if weights is not None else projected,
            weights_from="checkpoint files" if weights is not None else "from config",
            weights_bytes_from_config=projected,
            kv_bytes_per_token=shape.kv_bytes_per_token(a.kv_dtype_bytes),
            assumptions=a,
            fits=fits,
            bench_check=bench_check(bench.result if bench else None),
            shape_check=at_shape.result.main.ceiling if at_shape else None,
        )

    return run_stage(tracker, precision, Sized, inputs, work, force=force)
