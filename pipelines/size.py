"""The size stage: will each build fit the card's target GPUs, with how many users, and how fast?

Projections come from eval/sizing.py over the model's architecture (`source.config`, else the local
checkpoint's config.json; nothing is downloaded). Weights are the build's real weight files where
its quantize stage has run, else the precision's bytes per weight. Where the build was benchmarked,
the projection for the benchmark's own device (its bandwidth, its resident bytes) is set beside the
measured decode speed, and the ratio is logged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import eval.gpus as gpus
import eval.sizing as sizing
from pipelines.cards import ModelCard, architecture_config
from pipelines.errors import QevalError
from pipelines.stages import StageOutput, StageRecord, file_digest, read_manifest, run_stage, stage_dir
from pipelines.tracking import Tracker

STAGE = "size"


def architecture(card: ModelCard) -> tuple[sizing.Shape, Path]:
    """The model's shape from `source.config` or the local checkpoint's config.json."""
    path = architecture_config(card, "sizing")
    try:
        return sizing.Shape.from_config(json.loads(path.read_text())), path
    except (OSError, ValueError, KeyError) as e:
        raise QevalError(f"model '{card.name}': cannot read the architecture from {path}: {e}") from None


def real_weight_bytes(card: ModelCard, precision: str) -> float | None:
    """The build's weight files in bytes, where its quantize stage has run."""
    done = read_manifest(stage_dir(card.name, precision, "quantize"))
    if done and done.get("status") == "done" and "size/checkpoint_gb" in done["metrics"]:
        return done["metrics"]["size/checkpoint_gb"] * 1e9
    return None


def fits_table(
    card: ModelCard,
    precisions: list[str],
    gpu_names: list[str],
    *,
    batch: int,
    input_len: int,
    output_len: int,
    assumptions: sizing.Assumptions = sizing.Assumptions(),  # noqa: B008 - frozen
) -> list[sizing.Fit]:
    shape, _ = architecture(card)
    rows = []
    for precision in precisions:
        weights = real_weight_bytes(card, precision)
        for name in gpu_names:
            grid = {"batch": batch, "input_len": input_len, "output_len": output_len}
            rows.append(sizing.fit(shape, precision, gpus.get_gpu(name), **grid, weights=weights, a=assumptions))
    return rows


def bench_check(card: ModelCard, precision: str, shape: sizing.Shape) -> dict[str, float]:
    """Projected decode ceiling on the benchmark's own device beside the measured speed (batch 1)."""
    done = read_manifest(stage_dir(card.name, precision, "bench"))
    if not done or done.get("status") != "done" or done["inputs"]["config"].get("no_weights"):
        return {}
    s = done["summary"]
    measured = dict((int(b), v) for b, v in done["series"].get("engine/decode_tps", [])).get(1)
    if not measured:
        return {}
    context = card.speed.input_lengths[0] + card.speed.output_lengths[0] / 2
    step = sizing.decode_read_bytes(shape, s["weight_bytes"]) + s["kv_bytes_per_token"] * context
    ceiling = s["bandwidth_gb_s"] * 1e9 / step
    return {
        "size/bench_device_decode_ceiling": ceiling,
        "size/bench_device_decode_measured": measured,
        "size/bench_device_measured_over_ceiling": measured / ceiling,
    }


def size(card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False) -> StageRecord:
    """Project memory and speed of one build on the card's target GPUs and log them."""
    card.require_precision(precision)
    shape, config = architecture(card)
    s = card.speed
    batch, input_len, output_len = max(s.batch_sizes), s.input_lengths[0], s.output_lengths[0]
    weights = real_weight_bytes(card, precision)
    bench = read_manifest(stage_dir(card.name, precision, "bench"))
    inputs = {
        "config": file_digest([config]),
        "weights": weights,
        "gpus": card.target_gpus,
        "grid": [batch, input_len, output_len],
        "bench": [bench["inputs_digest"], bench["started"]] if bench else None,  # a forced rerun counts too
    }

    def work(out: Path) -> StageOutput:
        rows = fits_table(card, [precision], card.target_gpus, batch=batch, input_len=input_len, output_len=output_len)
        metrics: dict[str, float] = {
            "size/weights_gb": (weights if weights is not None else sizing.weight_bytes(shape, precision)) / 1e9,
            "size/weights_gb_from_config": sizing.weight_bytes(shape, precision) / 1e9,
            "size/kv_bytes_per_token": float(sizing.kv_bytes_per_token(shape)),
        }
        for f in rows:
            metrics |= {
                f"size/{f.gpu}/fits": float(f.fits),
                f"size/{f.gpu}/total_gb": f.total_gb,
                f"size/{f.gpu}/max_sequences": float(f.max_sequences),
                f"size/{f.gpu}/tensor_parallel": float(f.tensor_parallel or 0),
                f"size/{f.gpu}/decode_tps_ceiling": f.decode_tps_per_user,
                f"size/{f.gpu}/ttft_ms_floor": f.ttft_ms,
            }
        checked = bench_check(card, precision, shape)
        metrics |= checked
        table = [f.__dict__ for f in rows]
        (out / "fits.json").write_text(json.dumps(table, indent=2) + "\n")
        return StageOutput(
            metrics=metrics,
            params={
                "size.grid": f"batch {batch}, {input_len} in, {output_len} out",
                "size.weights": "checkpoint files" if weights is not None else "from config",
                "size.assumptions": json.dumps(sizing.Assumptions().__dict__),
            },
            summary={"fits": table, **checked},
        )

    return run_stage(tracker, precision, STAGE, inputs, _code(), work, force=force)


def summary_rows(rows: list[sizing.Fit]) -> list[dict[str, Any]]:
    return [
        {
            "gpu": f.gpu,
            "precision": f.precision,
            "runs": f.execution,
            "fits": "yes" if f.fits else (f"TP {f.tensor_parallel}" if f.tensor_parallel else "no"),
            "total GB": f"{f.total_gb:.1f}",
            "weights GB": f"{f.weights_gb:.2f}",
            "KV GB": f"{f.kv_gb:.2f}",
            "max seqs": str(f.max_sequences),
            "decode tok/s/user": f"{f.decode_tps_per_user:.0f}",
            "TTFT ms": f"{f.ttft_ms:.3g}",
        }
        for f in rows
    ]


def _code() -> list[Path]:
    return [Path(sizing.__file__), Path(gpus.__file__), Path(__file__)]
