"""The tables of what each stage's typed result logs to its build's run: metric name -> how the result
gives the figure, config field -> param name, and NAMES, every MLflow name qeval writes (docs/mlflow.md,
"MLflow layout", lists them; tests/test_tracking.py holds the two to each other).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from pipelines.core.store.results import Quantized
from pipelines.core.system.integrity import hashes_digest
from pipelines.tracking.names import (
    EVAL_DOCUMENTS,
    EVAL_METRIC,
    EXPERIMENT,
    GATE_PARAM,
    GATE_RECOVERY_WORST,
    GATE_RECOVERY_WORST_LOWER,
    GATE_SPEED,
    GATE_USERS_AT_SLO,
    GATE_WEIGHTS_GB,
    PARAM_PRECISION,
    RECOVERY_METRIC,
    SERVED_DIFF,
    SERVED_METRIC,
    TAG_CHOSEN,
    TAG_COMMIT,
    TAG_DESCRIPTION,
    TAG_DIGESTS,
    TAG_DIRTY,
    TAG_FILES,
    TAG_KIND,
    TAG_MODEL,
    TAG_NOT_RUN,
    TAG_PRECISION,
    TAG_REASONS,
    TAG_RUN_COLOUR,
    TAG_SHIPS,
    TAG_STAGE,
    TAG_STAGE_ERROR,
    TAG_SUPERSEDED,
    TAG_VERDICT,
    TAG_VIEW,
)
from quant.precisions import get_precision

Getter = Callable[[Any], Any]


def _grouped(q: Quantized) -> bool:
    return q.config is not None and get_precision(q.config.precision).grouped


QUANTIZE_METRICS: dict[str, Getter] = {
    "size/checkpoint_gb": lambda q: q.checkpoint_bytes / 1e9,
    "quant/kl_vs_baseline": lambda q: q.proof and q.proof.kl_vs_baseline,
    "quant/top1_agreement": lambda q: q.proof and q.proof.top1_agreement,
    "quant/seconds": lambda q: q.build and q.build.seconds,
    "quant/peak_rss_gb": lambda q: q.build and q.build.peak_rss_mb * 2**20 / 1e9,
}
BENCH_METRICS: dict[str, Getter] = {
    "mem/weights_gb": lambda b: b.engine.weight_bytes / 1e9,
    "mem/kv_bytes_per_token": lambda b: b.engine.kv_bytes_per_token,
}
BENCH_SERIES: dict[str, Getter] = {  # step = batch size, at the grid's main point
    "engine/ttft_ms": lambda p: p.ttft_ms_p50,
    "engine/decode_tps": lambda p: p.decode_tps_per_user,
    "engine/total_tps": lambda p: p.decode_tps_total,
    "engine/e2e_ms": lambda p: p.e2e_ms_p50,
    "engine/itl_ms": lambda p: p.itl_ms_p50,
    "engine/mbu": lambda p: p.mbu,
    "engine/total_chars_per_s": lambda p: p.chars_per_s_total,
    "mem/peak_gb": lambda p: p.peak_mem_bytes and p.peak_mem_bytes / 1e9,
}
SERVE_METRICS: dict[str, Getter] = {
    "server/max_users_at_slo": lambda s: s.max_users_at_slo,
    "server/users_at_slo_lo": lambda s: s.users_at_slo_interval and s.users_at_slo_interval[0],
    "server/users_at_slo_hi": lambda s: s.users_at_slo_interval and s.users_at_slo_interval[1],
    "server/failed_requests": lambda s: s.failed_requests,
    "server/generator_ceiling_chunks_s": lambda s: s.generator_ceiling.chunks_per_s,
    "server/served_accuracy_differs": lambda s: s.accuracy and len(s.accuracy.findings),
}
_LATENCY = [f"{m}_p{q}" for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") for q in (50, 90, 95, 99)]
_THROUGHPUT = ["output_tps", "output_tps_lo", "output_tps_hi", "output_tps_per_user", "request_tps", "goodput_rps"]
_COUNTS = ["slo_attainment", "failed", "bursts"]
SERVE_SERIES: dict[str, Getter] = {  # step = concurrency
    **{f"server/{name}": (lambda n: lambda m: getattr(m, n))(name) for name in _LATENCY + _THROUGHPUT + _COUNTS},
    # the server's own view of each level (its /metrics; eval/load/server_view.py), where it exports vLLM's
    **{
        f"server/metrics_{name}": (lambda n: lambda m: m.server and getattr(m.server, n))(name)
        for name in ("preemptions", "ttft_ms_mean", "tpot_ms_mean", "queue_ms_mean", "prefill_ms_mean")
    },
}
# the shape stage (random weights at the model's shape): its own names, never a real checkpoint's server/*;
# per scenario (the card's speed.scenarios, `default` where it names none) under shape/<scenario>/
SHAPE_METRICS: dict[str, Getter] = {"shape/generator_ceiling_chunks_s": lambda s: s.generator_ceiling.chunks_per_s}
SHAPE_SCENARIO = "shape/{scenario}/"
SHAPE_SCENARIO_METRICS: dict[str, Getter] = {  # of a ScenarioSweep, each name after SHAPE_SCENARIO
    "max_users_at_slo": lambda s: s.max_users_at_slo,
    "failed_requests": lambda s: s.failed_requests,
    "probe_ttft_ms": lambda s: s.probe and s.probe.ttft_ms,
    "probe_tpot_ms": lambda s: s.probe and s.probe.tpot_ms,
    "decode_step_bytes": lambda s: s.ceiling and s.ceiling.step_bytes,
    "decode_ceiling_tps": lambda s: s.ceiling and s.ceiling.ceiling_tps,
    "decode_measured_tps": lambda s: s.ceiling and s.ceiling.measured_tps,
    "decode_measured_over_ceiling": lambda s: s.ceiling and s.ceiling.measured_over_ceiling,
    "bandwidth_gb_s": lambda s: s.ceiling and s.ceiling.bandwidth_gb_s,
}
SHAPE_SERIES: dict[str, Getter] = {  # step = concurrency, each name after SHAPE_SCENARIO; the server's view is serve's
    name.removeprefix("server/"): get for name, get in SERVE_SERIES.items() if not name.startswith("server/metrics_")
}
SIZE_METRICS: dict[str, Getter] = {
    "size/weights_gb": lambda s: s.weights_bytes / 1e9,
    "size/weights_gb_from_config": lambda s: s.weights_bytes_from_config / 1e9,
    "size/kv_bytes_per_token": lambda s: s.kv_bytes_per_token,
    "size/bench_device_decode_ceiling": lambda s: s.bench_check and s.bench_check.decode_ceiling,
    "size/bench_device_decode_measured": lambda s: s.bench_check and s.bench_check.decode_measured,
    "size/bench_device_measured_over_ceiling": lambda s: s.bench_check and s.bench_check.measured_over_ceiling,
    "size/shape_measured_over_ceiling": lambda s: s.shape_check and s.shape_check.measured_over_ceiling,
}
SIZE_GPU_FIGURES: dict[str, Getter] = {  # size/<gpu>/<figure>, per target GPU
    "fits": lambda f: f.fits,
    "total_gb": lambda f: f.total_gb,
    "max_sequences": lambda f: f.max_sequences,
    "tensor_parallel": lambda f: f.tensor_parallel or 0,
    "decode_tps_ceiling": lambda f: f.decode_tps_per_user,
    "ttft_ms_floor": lambda f: f.ttft_ms,
}
GATE_METRICS: dict[str, Getter] = {  # on every build's run, from its verdict
    GATE_RECOVERY_WORST: lambda b: b.worst_task()[1].recovery[0] if b.tasks else 1.0,
    GATE_RECOVERY_WORST_LOWER: lambda b: b.worst_task()[1].recovery[1] if b.tasks else None,
    "gate/speedup": lambda b: b.speedup,
    GATE_SPEED: lambda b: b.speed.speed,  # the figure the speed rule used, in the card's regime
    GATE_WEIGHTS_GB: lambda b: b.speed.weights_gb,
    "gate/peak_gb": lambda b: b.speed.peak_gb,
    "gate/decode_tps": lambda b: b.speed.decode_tps,
    "gate/goodput_rps": lambda b: b.speed.goodput,
    GATE_USERS_AT_SLO: lambda b: b.speed.users_at_slo,
    # the card's traffic on the device the gate judges cost on (pipelines/present/capacity.py)
    "cost/usd_per_mtok": lambda b: b.speed.cost.usd_per_mtok if b.speed.cost else None,
    "cost/usd_per_hour": lambda b: b.speed.cost.usd_per_hour if b.speed.cost else None,
    "cost/devices": lambda b: b.speed.cost.devices if b.speed.cost else None,
    "cost/users_per_instance": lambda b: b.speed.cost.users_per_instance if b.speed.cost else None,
    "cost/measured": lambda b: float(b.speed.cost.measured) if b.speed.cost else None,  # 1 measured, 0 projected
    "cost/at_most": lambda b: b.speed.cost and float(bool(b.speed.cost.at_most)),  # 1: no level missed, upper bounds
    "cost/usd_per_mtok_lo": lambda b: b.speed.cost and b.speed.cost.mtok_end(0),  # the range's optimistic end
    "cost/usd_per_mtok_hi": lambda b: b.speed.cost and b.speed.cost.mtok_end(1),  # and its conservative one
    "cost/judged": lambda b: b.speed.cost and b.speed.cost.judged,  # what the gate judges (CostFigure.judged)
}
GATE_TASK = "gate/{task}/"
GATE_GENERATION: dict[str, Getter] = {  # GATE_TASK + name, per generative task, from its `Generation`
    "length_ratio": lambda g: g.length.ratio[0],  # its total output tokens over the baseline's
    "length_ratio_lower": lambda g: g.length.ratio[1],
    "length_ratio_upper": lambda g: g.length.ratio[2],
    "departure_median": lambda g: g.departures.median,  # among the outputs that depart from the baseline's
    "identical_share": lambda g: g.departures.identical / len(g.departures.positions),
}
GATE_FLIPS: dict[str, Getter] = {  # GATE_TASK + name, per multiple-choice task, from its `Flips`
    "flip_rate": lambda f: f.rate[0],  # the share of answers that differ from the baseline's
    "flip_rate_lower": lambda f: f.rate[1],
    "flip_rate_upper": lambda f: f.rate[2],
}

SENSITIVITY_METRICS: dict[str, Getter] = {  # of a Ranked (the search's ranking, on its target's run)
    "sensitivity/top_half_kl": lambda r: r.top_half_kl,
    "sensitivity/bottom_half_kl": lambda r: r.bottom_half_kl,
    "sensitivity/tokens": lambda r: r.tokens,
}
SENSITIVITY_SERIES = {  # name -> step: the rank of a group (0: the most sensitive), or the groups a mix keeps
    "sensitivity/kl_by_rank": "rank",
    "search/predicted_kl": "kept",
    "search/projected_weights_gb": "kept",
}
SENSITIVITY_PARAMS: dict[str, Getter] = {
    "sensitivity.fallback": lambda r: r.fallback,
    "sensitivity.ranking": lambda r: [g.group for g in r.ranked][:40],
}

# Params: every setting that changes a result. Each table maps a field of the stage's config to its
# param; NOT_SETTINGS names the fields that are not settings (tests/test_tracking.py checks coverage).
QUANTIZE_SETTINGS = {
    "group_size": "quant.group_size",
    "ignore": "quant.ignore",
    "calibration": "quant.calibration",
    "trust_remote_code": "quant.trust_remote_code",
    "seed": "quant.seed",
    "dtype": "quant.dtype",
}
VERIFY_SETTINGS = {"max_tokens": "quant.verify_max_tokens", "min_agreement": "quant.verify_min_agreement"}
EVAL_SETTINGS = {
    "tasks": "eval.tasks",
    "num_fewshot": "eval.num_fewshot",
    "limit": "eval.limit",
    "batch_size": "eval.batch_size",
    "seed": "eval.seed",
    "device": "eval.device",
    "dtype": "eval.dtype",
    "softmax_dtype": "eval.softmax_dtype",
    "kv_cache_dtype": "eval.kv_cache_dtype",
    "fp8_query": "eval.fp8_query",
    "bootstrap_iters": "eval.bootstrap_iters",
    "trust_remote_code": "eval.trust_remote_code",
    "backend": "eval.backend",
    "tensor_parallel": "eval.tensor_parallel",
    "vllm_memory_share": "eval.vllm_memory_share",
    "vllm_eager": "eval.vllm_eager",
    "max_length": "eval.max_length",
    "max_seq_lengths": "eval.max_seq_lengths",
    "one_at_a_time": "eval.one_at_a_time",
    "rounds": "eval.rounds",
}
VLLM_SETTINGS = {
    "device": "server.device",
    "max_model_len": "server.max_model_len",
    "tensor_parallel": "server.tensor_parallel",
    "pipeline_parallel": "server.pipeline_parallel",
    "kv_cache_dtype": "server.kv_cache_dtype",
    "enforce_eager": "server.enforce_eager",
    "cpu_kv_cache_gb": "server.cpu_kv_cache_gb",
    "gpu_memory_utilization": "server.gpu_memory_utilization",
    "seed": "server.seed",
    "random_weights": "server.random_weights",
    "dtype": "server.dtype",
    "torch_onednn": "server.torch_onednn",
}
ENGINE_SETTINGS = {
    "no_weights": "engine.weights",
    "batch_sizes": "engine.batch_sizes",
    "input_lengths": "engine.input_lengths",
    "output_lengths": "engine.output_lengths",
    "warmup": "engine.warmup",
    "repeats": "engine.repeats",
    "device": "engine.device",
    "dtype": "engine.dtype",
    "compile": "engine.compile",
    "kv_cache_dtype": "engine.kv_cache_dtype",
    "bandwidth_gb_s": "engine.bandwidth_gb_s",
    "trust_remote_code": "engine.trust_remote_code",
    "seed": "engine.seed",
}
LOAD_SETTINGS = {
    "api": "server.api",
    "concurrency": "server.concurrency",
    "requests_per_user": "server.requests_per_user",
    "warmup": "server.warmup",
    "input_len": "server.input_len",
    "output_len": "server.output_len",
    "exact_length": "server.exact_length",
    "timeout_s": "server.timeout_s",
    "warmup_timeout_s": "server.warmup_timeout_s",
    "edge": "server.edge",
}
SHAPE_LOAD_SETTINGS = {k: v.replace("server.", "shape.{scenario}.", 1) for k, v in LOAD_SETTINGS.items()}
SHAPE_VLLM_SETTINGS = {k: v.replace("server.", "shape.", 1) for k, v in VLLM_SETTINGS.items()}
NOT_SETTINGS = {  # config type name -> its fields that are not settings, and why
    "QuantizeConfig": {
        "base": "a path; its digest is in the cache key",
        "precision": "the run's tag",
        "target_modules": "a mix's layers, in its manifest (quant.fallback_layers counts those kept)",
        "fallback_modules": "quant.fallback_layers",
    },
    "VerifyConfig": {
        "base": "a path",
        "checkpoint": "a path",
        "precision": "the run's tag",
        "trust_remote_code": "quant.trust_remote_code",
        "dtype": "quant.dtype",
        "device": "where both models ran: the stage's environment (the GPU's name, or the CPU) says",
        "layer_formats": "a mix's layers, as the quantize stage names them (quant.fallback_layers)",
    },
    "AccuracyConfig": {
        "checkpoint": "a path",
        "include_path": "a path; eval.task_data_sha256 identifies it",
        "base_url": "a loopback port of the moment",
        "served_model": "the checkpoint's path, as the server names it",
        "stop": "the card's gate (its rules) and the baseline's evaluation: param eval.stop_scoring says when",
    },
    "VllmSettings": {"positions": "the checkpoint's own (config.json), where max_model_len exceeds them"},
    "EngineConfig": {"checkpoint": "a path", "precision": "the run's tag"},
}
QUANTIZE_PARAMS: dict[str, Getter] = {  # derived from the result; override a setting of the same name
    "quant.scheme": lambda q: q.scheme,
    "quant.base": lambda q: q.source,
    "quant.shares": lambda q: q.shares,  # a KV-cache variant: the build whose checkpoint it serves
    "quant.fallback_layers": lambda q: q.config and q.config.fallback_modules and len(q.config.fallback_modules),
    "quant.format": lambda q: q.proof and q.proof.format,
    "quant.weight_bits": lambda q: q.proof and q.proof.weight_bits,
    "quant.group_size": lambda q: q.config and (q.config.group_size if _grouped(q) else "per-channel"),
    "quant.calibration": lambda q: q.config and q.config.calibration and q.config.calibration.dataset,
    "quant.calibration_max_seq_length": lambda q: (c := q.config and q.config.calibration) and c.max_seq_length,
    "quant.calibration_samples": lambda q: q.build and q.config.calibration and q.build.calibration_samples,
    "quant.calibration_tokens": lambda q: q.build and q.config.calibration and q.build.calibration_tokens,
    "quant.calibration_sha256": lambda q: q.build and q.build.calibration_sha256,
    "quant.files_sha256": lambda q: q.files and hashes_digest(q.files),  # new bytes, a new run (and version)
}
EVAL_PARAMS: dict[str, Getter] = {
    "eval.backend": lambda e: e.accuracy.backend,
    "eval.task_data_sha256": lambda e: e.task_data_sha256 or "hub",
    "eval.stop_scoring": lambda e: e.config.stop.when if e.config.stop else "never",
    "eval.not_scored": lambda e: ", ".join(e.accuracy.not_scored) or "none",
    "eval.stopped": lambda e: e.accuracy.stopped() or "none",
}
BENCH_PARAMS: dict[str, Getter] = {
    "engine.device": lambda b: b.engine.device_name,
    "engine.engine": lambda b: b.engine.engine,
    "engine.kernels": lambda b: b.engine.kernels,
    "engine.weights": lambda b: "random (no_weights)" if b.config.no_weights else "checkpoint",
    "engine.input_len": lambda b: b.input_len,
    "engine.output_len": lambda b: b.output_len,
    "engine.bandwidth_gb_s": lambda b: f"{b.engine.bandwidth_gb_s:.1f} ({b.engine.bandwidth_source})",
}
SERVE_PARAMS: dict[str, Getter] = {
    "server.engine": lambda s: s.engine,
    "server.engine_version": lambda s: s.engine_version,
    "server.kernels": lambda s: s.kernel_names if s.engine == "vllm" else None,
    "server.execution": lambda s: s.execution,
    "server.accuracy_tasks": lambda s: s.accuracy and s.accuracy.config.tasks,
    "server.accuracy_limit": lambda s: s.accuracy and str(s.accuracy.config.limit),
    "server.accuracy_batch_size": lambda s: s.accuracy and s.accuracy.config.batch_size,
    "server.slo": lambda s: f"TTFT p95 <= {s.slo.ttft_ms:g} ms, TPOT p95 <= {s.slo.tpot_ms:g} ms",
    "server.starts": lambda s: s.starts,
    "server.users_bound": lambda s: s.users_bound,  # no level missed: why the load went no higher
}
SHAPE_PARAMS: dict[str, Getter] = {
    "shape.weights": lambda s: s.weights,
    "shape.config": lambda s: s.shape_config,
    "shape.engine_version": lambda s: s.engine_version,
    "shape.kernels": lambda s: s.kernel_names,
    "shape.execution": lambda s: s.execution,
    "shape.device": lambda s: s.main.ceiling and s.main.ceiling.device,
    "shape.bandwidth": lambda s: (
        s.main.ceiling and f"{s.main.ceiling.bandwidth_gb_s:.1f} GB/s ({s.main.ceiling.bandwidth_source})"
    ),
    "shape.scenarios": lambda s: list(s.scenarios),
}
SHAPE_SCENARIO_PARAMS: dict[str, Getter] = {  # of a ScenarioSweep
    "shape.{scenario}.probe": lambda s: s.probe and s.probe.why,
    "shape.{scenario}.slo": lambda s: f"TTFT p95 <= {s.slo.ttft_ms:g} ms, TPOT p95 <= {s.slo.tpot_ms:g} ms",
    "shape.{scenario}.capped": lambda s: s.capped,
    "shape.{scenario}.users_bound": lambda s: s.users_bound,
}
SIZE_PARAMS: dict[str, Getter] = {
    "size.grid": lambda s: f"batch {s.batch}, {s.input_len} in, {s.output_len} out",
    "size.gpus": lambda s: [f.gpu for f in s.fits],
    "size.group_size": lambda s: s.group_size,
    "size.weights": lambda s: s.weights_from,
    "size.assumptions": lambda s: json.dumps(asdict(s.assumptions)),
}


def _templated(name: str) -> str:
    return name.replace("{", "<").replace("}", ">")


NAMES: dict[str, list[str]] = {
    "experiment": [EXPERIMENT],
    "metrics": [
        *QUANTIZE_METRICS,
        *BENCH_METRICS,
        *SERVE_METRICS,
        *SHAPE_METRICS,
        *SIZE_METRICS,
        *SENSITIVITY_METRICS,
        *GATE_METRICS,
        *(_templated(SHAPE_SCENARIO + n) for n in SHAPE_SCENARIO_METRICS),
        *(_templated(n) for n in (EVAL_METRIC, EVAL_DOCUMENTS, RECOVERY_METRIC, SERVED_METRIC)),
        "eval/<task>/<metric>_stderr",
        *(_templated(SERVED_DIFF).replace("<bound>", b) for b in ("", "_lower", "_upper")),
        *(f"size/<gpu>/{f}" for f in SIZE_GPU_FIGURES),
        *(_templated(GATE_TASK + n) for n in (*GATE_GENERATION, *GATE_FLIPS)),
    ],
    "series": [
        *BENCH_SERIES,
        *SERVE_SERIES,
        *SENSITIVITY_SERIES,
        *(_templated(SHAPE_SCENARIO + n) for n in SHAPE_SERIES),
    ],
    "params": sorted(
        {
            *QUANTIZE_SETTINGS.values(),
            *VERIFY_SETTINGS.values(),
            *EVAL_SETTINGS.values(),
            *ENGINE_SETTINGS.values(),
            *LOAD_SETTINGS.values(),
            *VLLM_SETTINGS.values(),
            *QUANTIZE_PARAMS,
            *EVAL_PARAMS,
            *BENCH_PARAMS,
            *SERVE_PARAMS,
            *SHAPE_PARAMS,
            *map(_templated, [*SHAPE_SCENARIO_PARAMS, *SHAPE_LOAD_SETTINGS.values()]),
            *SHAPE_VLLM_SETTINGS.values(),
            *SIZE_PARAMS,
            *SENSITIVITY_PARAMS,
            _templated(GATE_PARAM),
            PARAM_PRECISION,
        }
    ),
    "tags": [
        TAG_DESCRIPTION,
        TAG_RUN_COLOUR,
        TAG_MODEL,
        TAG_PRECISION,
        TAG_KIND,
        TAG_SUPERSEDED,
        TAG_VERDICT,
        TAG_REASONS,
        TAG_CHOSEN,
        TAG_SHIPS,
        TAG_COMMIT,
        TAG_DIRTY,
        TAG_DIGESTS,
        *(_templated(t) for t in (TAG_STAGE, TAG_STAGE_ERROR, TAG_NOT_RUN)),
        TAG_VIEW,
        TAG_FILES,
    ],
}
