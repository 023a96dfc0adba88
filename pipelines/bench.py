"""The bench stage: in-process generation speed and memory of one build over the card's grid.

Metrics follow the MLflow contract: `engine/*` with step = batch size at the grid's main point (the
first input and output length, logged as params), `mem/*`, and the whole grid as grid.csv. A decode
speed-up over the baseline beyond what the resident weight bytes allow is flagged as suspect.
"""

from __future__ import annotations

import logging
from pathlib import Path

import eval.engine as engine
import eval.speed as speed
from pipelines.cards import ModelCard, architecture_config, offline_env
from pipelines.child import run_child
from pipelines.errors import QevalError
from pipelines.quantize import checkpoint_for
from pipelines.stages import StageOutput, StageRecord, file_digest, read_manifest, run_stage, stage_dir
from pipelines.tracking import Tracker

STAGE = "bench"
log = logging.getLogger(__name__)


def bench(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, no_weights: bool = False
) -> StageRecord:
    """Benchmark one build's generation over the card's speed grid and log it.

    With `no_weights`, the baseline's architecture is built with random weights (speed and memory
    only, nothing downloaded): from `source.config`, else from the local checkpoint's config.json.
    """
    if no_weights:
        checkpoint, checkpoint_id = _shape(card, precision)
    else:
        checkpoint, checkpoint_id = checkpoint_for(card, precision)
    s = card.speed
    cfg = engine.EngineConfig(
        checkpoint=checkpoint,
        precision=precision,
        no_weights=no_weights,
        batch_sizes=s.batch_sizes,
        input_lengths=s.input_lengths,
        output_lengths=s.output_lengths,
        warmup=s.warmup,
        repeats=s.repeats,
        compile=s.compile,
        quantized=precision != card.gate.baseline,
        trust_remote_code=card.source.trust_remote_code,
    )
    baseline = (
        None if precision == card.gate.baseline else read_manifest(stage_dir(card.name, card.gate.baseline, STAGE))
    )
    inputs = {
        "checkpoint": checkpoint_id,
        "config": cfg.model_dump(exclude={"checkpoint"}),
        "baseline": baseline["inputs_digest"] if baseline else None,
    }

    def work(out: Path) -> StageOutput:
        result = run_child(
            "eval.engine:bench_engine", cfg, out, engine.EngineResult, out / "bench.log", offline_env(card)
        )
        main = [p for p in result.points if (p.input_len, p.output_len) == (s.input_lengths[0], s.output_lengths[0])]
        ok = [p for p in main if p.status == "ok"]
        series = {
            name: [(p.batch, getattr(p, field)) for p in ok if getattr(p, field) is not None]
            for name, field in (
                ("engine/ttft_ms", "ttft_ms_p50"),
                ("engine/decode_tps", "decode_tps_per_user"),
                ("engine/total_tps", "decode_tps_total"),
                ("engine/e2e_ms", "e2e_ms_p50"),
                ("engine/itl_ms", "itl_ms_p50"),
                ("engine/mbu", "mbu"),
                ("engine/total_chars_per_s", "chars_per_s_total"),
                ("mem/peak_gb", "peak_mem_bytes"),
            )
        }
        series["mem/peak_gb"] = [(b, v / 1e9) for b, v in series["mem/peak_gb"]]
        metrics = {"mem/weights_gb": result.weight_bytes / 1e9, "mem/kv_bytes_per_token": result.kv_bytes_per_token}
        summary = {**result.model_dump(exclude={"points"}), "oom_points": sum(p.status == "oom" for p in result.points)}
        if baseline and ok:
            summary |= _speedup(baseline, result, ok)
        return StageOutput(
            metrics=metrics,
            series=series,
            params={
                "engine.device": result.device_name,
                "engine.engine": result.engine,
                "engine.kernels": result.kernels,
                "engine.weights": "random (no_weights)" if no_weights else "checkpoint",
                "engine.input_len": str(s.input_lengths[0]),
                "engine.output_len": str(s.output_lengths[0]),
                "engine.repeats": str(s.repeats),
                "engine.bandwidth_gb_s": f"{result.bandwidth_gb_s:.1f} ({result.bandwidth_source})",
            },
            summary=summary,
        )

    return run_stage(tracker, precision, STAGE, inputs, _code(), work, force=force)


def _shape(card: ModelCard, precision: str) -> tuple[str, str]:
    """The config.json that gives the model's architecture, for random-weight benchmarks."""
    if precision != card.gate.baseline:
        raise QevalError(
            f"--no-weights measures the {card.gate.baseline} baseline only: random weights are not quantized"
        )
    path = architecture_config(card, "--no-weights")
    return str(path), file_digest([path])


def _speedup(baseline: dict, result: engine.EngineResult, ok: list[engine.PointResult]) -> dict:
    """Decode speed-up over the baseline at the smallest batch, flagged when the bytes cannot explain it."""
    base_points = baseline["series"].get("engine/decode_tps", [])
    small = min(ok, key=lambda p: p.batch)
    base = dict((int(b), v) for b, v in base_points).get(small.batch)
    if not base or not small.decode_tps_per_user:
        return {}
    up = small.decode_tps_per_user / base
    ratio = baseline["summary"]["weight_bytes"] / result.weight_bytes
    suspect = speed.speedup_is_suspect(up, ratio)
    same = baseline["summary"].get("engine") == result.engine
    if not same:
        log.warning(
            "%s: measured with %s, the baseline with %s: the speed-up compares different harnesses",
            result.precision,
            result.engine,
            baseline["summary"].get("engine"),
        )
    if suspect:
        log.warning(
            "%s: decode speed-up %.2fx over the baseline exceeds the %.2fx its weight bytes allow: suspect",
            result.precision,
            up,
            ratio,
        )
    return {
        "speedup_vs_baseline": up,
        "byte_ratio_vs_baseline": ratio,
        "speedup_suspect": suspect,
        "same_engine_as_baseline": same,
    }


def _code() -> list[Path]:
    return [
        Path(engine.__file__),
        Path(speed.__file__),
        Path(engine.__file__).with_name("gpus.py"),
        Path(__file__),
        Path(run_child.__code__.co_filename),
    ]
