"""The bench stage: in-process generation speed and memory of one build over the card's grid.

Single figures are taken at the grid's main point (its first input and output length); the whole grid
goes to grid.csv. A decode speed-up over the baseline beyond what the resident weight bytes allow is
flagged as suspect, and one measured on another harness than the baseline's (compiled against eager)
is flagged as such.
"""

from __future__ import annotations

import logging
from pathlib import Path

import eval.bench.engine as engine
import eval.devices.speed as speed
from pipelines.core.card.cards import ModelCard
from pipelines.core.framework.demands import check_bench
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import architecture_config, checkpoint_for, offline_env
from pipelines.core.store.layout import STAGE_LOG
from pipelines.core.store.manifests import StageRecord, finished
from pipelines.core.store.results import Benched, Speedup
from pipelines.core.system.child import run_child
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import file_digest
from pipelines.stages.engines import cuda_available
from quant.precisions import kv_cache_dtype

log = logging.getLogger(__name__)


def bench(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, no_weights: bool = False
) -> StageRecord[Benched]:
    """Benchmark one build's generation over the card's speed grid and log it.

    With `no_weights`, the baseline's architecture is built with random weights (speed and memory
    only, nothing downloaded): from `source.config`, else from the local checkpoint's config.json.
    """
    # the grid against the model's lengths and this machine, before anything starts
    check_bench(card, in_host_memory=not cuda_available())
    checkpoint, checkpoint_id = _shape(card, precision) if no_weights else checkpoint_for(card, precision)
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
        trust_remote_code=card.source.trust_remote_code,
        kv_cache_dtype=kv_cache_dtype(precision, card.server.kv_cache_dtype),
    )
    baseline = None if precision == card.gate.baseline else finished(card.name, card.gate.baseline, Benched)
    inputs = {
        "checkpoint": checkpoint_id,
        "config": cfg.model_dump(mode="json", exclude={"checkpoint"}),
        "baseline": baseline.inputs_digest if baseline else None,
    }

    def work(out: Path) -> Benched:
        result = run_child(engine.bench_engine, cfg, out, out / STAGE_LOG, offline_env(card))
        done = Benched(config=cfg, engine=result, input_len=s.input_len, output_len=s.output_len)
        return done.model_copy(update={"speedup": _speedup(baseline.result, done)}) if baseline else done

    return run_stage(tracker, precision, Benched, inputs, work, force=force)


def _shape(card: ModelCard, precision: str) -> tuple[str, str]:
    """The config.json that gives the model's architecture, for random-weight benchmarks."""
    if precision != card.gate.baseline:
        raise QevalError(
            f"--no-weights measures the {card.gate.baseline} baseline only: random weights are not quantized"
        )
    path = architecture_config(card, "--no-weights")
    return str(path), file_digest([path])


def _speedup(baseline: Benched, build: Benched) -> Speedup | None:
    """Decode speed-up over the baseline at the smallest batch, flagged when the bytes cannot explain it."""
    points = build.main_points()
    if not points:
        return None
    small = points[0]
    base = baseline.at(small.batch)
    if base is None or not base.decode_tps_per_user or not small.decode_tps_per_user:
        return None
    up = small.decode_tps_per_user / base.decode_tps_per_user
    ratio = baseline.engine.weight_bytes / build.engine.weight_bytes
    suspect = speed.speedup_is_suspect(up, ratio)
    same = baseline.engine.engine == build.engine.engine
    if not same:
        log.warning(
            "%s: measured with %s, the baseline with %s: the speed-up compares different harnesses",
            build.engine.precision,
            build.engine.engine,
            baseline.engine.engine,
        )
    if suspect:
        log.warning(
            "%s: decode speed-up %.2fx over the baseline exceeds the %.2fx its weight bytes allow: suspect",
            build.engine.precision,
            up,
            ratio,
        )
    return Speedup(
        speedup_vs_baseline=up, byte_ratio_vs_baseline=ratio, speedup_suspect=suspect, same_engine_as_baseline=same
    )
