"""Every MLflow name qeval writes, and the pure functions that turn typed results into them.

One experiment per model (`qeval/<model>`), one run per build (`<model>@<precision>`); each stage adds
its metrics, params and artifacts to that run and sets the tag `qeval.stage.<stage>` to `done` or
`failed`. A summary run per model holds the gate's policy, its decision and the report. The typed results
of pipelines/results.py become MLflow names here (logged(), verdict_metrics(), decision_params(), the
runs page's view), with no MLflow import; pipelines/tracking.py writes them to the store, and
tests/memory_tracker.py keeps the same in memory. README.md ("MLflow layout") lists the names;
tests/test_tracking.py holds it to NAMES.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipelines import present
from pipelines.results import (
    Benched,
    BuildVerdict,
    CodeVersion,
    Decision,
    Evaluated,
    Measured,
    Quantized,
    Served,
    Sized,
    StageResult,
)
from quant.precisions import get_precision

# ---- names ------------------------------------------------------------------------------------------

EXPERIMENT_KIND_TAG = ("mlflow.experimentKind", "custom_model_development")
# Set by qeval for MLflow's own UI: the run's note ("Description"), the colour its dot and chart lines get,
# and a saved view of the runs page (columns and charts) that `qeval ui`'s link opens.
TAG_DESCRIPTION, TAG_RUN_COLOUR = "mlflow.note.content", "mlflow.runColor"
VIEW_KEY = "qeval"
TAG_VIEW = "mlflow.sharedViewState." + VIEW_KEY
PARAM_PRECISION = "precision"
TAG_MODEL, TAG_PRECISION = "qeval.model", "qeval.precision"
TAG_KIND, KIND_SUMMARY = "qeval.kind", "summary"
TAG_SUPERSEDED = "qeval.superseded_by"
TAG_VERDICT, TAG_REASONS, TAG_CHOSEN = "qeval.gate.verdict", "qeval.gate.reasons", "qeval.gate.chosen"
TAG_SHIPS = "qeval.chosen"  # on the summary run: the precision that ships, or none
TAG_COMMIT, TAG_DIRTY = "mlflow.source.git.commit", "qeval.git_dirty"
TAG_STAGE, TAG_STAGE_ERROR = "qeval.stage.{stage}", "qeval.stage.{stage}.error"
TAG_DIGESTS = "qeval.digests"  # {stage: cache key} as JSON: one tag, not one per stage in the run page's tags
SHIP_ALIAS = "ship"
MAX_TAG = 5000  # MLflow's limit on a tag value is 8000 characters; keep errors well inside it.

EVAL_METRIC = "eval/{task}/{metric}"
EVAL_STDERR = "eval/{task}/{name}_stderr{filter}"
RECOVERY_METRIC = "recovery/{task}/{metric}"
SERVED_METRIC = "served/{task}/{metric}"  # lm-eval through the build's server
SERVED_DIFF = "served_vs_offline/{task}/{metric}{bound}"  # served - offline, paired; bound: "", _lower, _upper
SIZE_GPU_METRIC = "size/{gpu}/{figure}"

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
    "server/failed_requests": lambda s: s.failed_requests,
    "server/generator_ceiling_chunks_s": lambda s: s.generator_ceiling.chunks_per_s,
    "server/served_accuracy_differs": lambda s: s.accuracy and len(s.accuracy.findings),
}
_LATENCY = [f"{m}_p{q}" for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") for q in (50, 90, 95, 99)]
_THROUGHPUT = ["output_tps", "output_tps_per_user", "request_tps", "goodput_rps", "slo_attainment", "failed", "bursts"]
SERVE_SERIES: dict[str, Getter] = {  # step = concurrency
    f"server/{name}": (lambda n: lambda m: getattr(m, n))(name) for name in _LATENCY + _THROUGHPUT
}
SIZE_METRICS: dict[str, Getter] = {
    "size/weights_gb": lambda s: s.weights_bytes / 1e9,
    "size/weights_gb_from_config": lambda s: s.weights_bytes_from_config / 1e9,
    "size/kv_bytes_per_token": lambda s: s.kv_bytes_per_token,
    "size/bench_device_decode_ceiling": lambda s: s.bench_check and s.bench_check.decode_ceiling,
    "size/bench_device_decode_measured": lambda s: s.bench_check and s.bench_check.decode_measured,
    "size/bench_device_measured_over_ceiling": lambda s: s.bench_check and s.bench_check.measured_over_ceiling,
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
    "gate/recovery_worst": lambda b: b.worst_task()[1].recovery[0] if b.tasks else 1.0,
    "gate/recovery_worst_lower": lambda b: b.worst_task()[1].recovery[1] if b.tasks else None,
    "gate/speedup": lambda b: b.speedup,
    "gate/speed": lambda b: b.speed.speed,  # the figure the speed rule used, in the card's regime
    "gate/weights_gb": lambda b: b.speed.weights_gb,
    "gate/peak_gb": lambda b: b.speed.peak_gb,
    "gate/decode_tps": lambda b: b.speed.decode_tps,
    "gate/goodput_rps": lambda b: b.speed.goodput,
    "gate/users_at_slo": lambda b: b.speed.users_at_slo,
}

# Params: every setting that changes a result. Each table maps a field of the stage's config to its
# param; NOT_SETTINGS names the fields that are not settings (tests/test_tracking.py checks coverage).
QUANTIZE_SETTINGS = {
    "group_size": "quant.group_size",
    "ignore": "quant.ignore",
    "calibration": "quant.calibration",
    "trust_remote_code": "quant.trust_remote_code",
    "seed": "quant.seed",
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
    "bootstrap_iters": "eval.bootstrap_iters",
    "trust_remote_code": "eval.trust_remote_code",
    "backend": "eval.backend",
    "tensor_parallel": "eval.tensor_parallel",
    "max_length": "eval.max_length",
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
}
NOT_SETTINGS = {  # config type name -> its fields that are not settings, and why
    "QuantizeConfig": {"base": "a path; its digest is in the cache key", "precision": "the run's tag"},
    "VerifyConfig": {
        "base": "a path",
        "checkpoint": "a path",
        "precision": "the run's tag",
        "trust_remote_code": "quant.trust_remote_code",
    },
    "AccuracyConfig": {
        "checkpoint": "a path",
        "include_path": "a path; eval.task_data_sha256 identifies it",
        "base_url": "a loopback port of the moment",
        "served_model": "the checkpoint's path, as the server names it",
    },
    "VllmSettings": {"positions": "the checkpoint's own (config.json), where max_model_len exceeds them"},
    "EngineConfig": {"checkpoint": "a path", "precision": "the run's tag", "quantized": "follows the precision"},
}
QUANTIZE_PARAMS: dict[str, Getter] = {  # derived from the result; override a setting of the same name
    "quant.scheme": lambda q: q.scheme,
    "quant.base": lambda q: q.source,
    "quant.format": lambda q: q.proof and q.proof.format,
    "quant.weight_bits": lambda q: q.proof and q.proof.weight_bits,
    "quant.group_size": lambda q: q.config and (q.config.group_size if _grouped(q) else "per-channel"),
    "quant.calibration": lambda q: q.config and q.config.calibration and q.config.calibration.dataset,
    "quant.calibration_max_seq_length": lambda q: (
        q.config and q.config.calibration and q.config.calibration.max_seq_length
    ),
    "quant.calibration_samples": lambda q: q.build and q.config.calibration and q.build.calibration_samples,
    "quant.calibration_tokens": lambda q: q.build and q.config.calibration and q.build.calibration_tokens,
    "quant.calibration_sha256": lambda q: q.build and q.build.calibration_sha256,
}
EVAL_PARAMS: dict[str, Getter] = {
    "eval.backend": lambda e: e.accuracy.backend,
    "eval.task_data_sha256": lambda e: e.task_data_sha256 or "hub",
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
}
SIZE_PARAMS: dict[str, Getter] = {
    "size.grid": lambda s: f"batch {s.batch}, {s.input_len} in, {s.output_len} out",
    "size.gpus": lambda s: [f.gpu for f in s.fits],
    "size.group_size": lambda s: s.group_size,
    "size.weights": lambda s: s.weights_from,
    "size.assumptions": lambda s: json.dumps(s.assumptions.__dict__),
}
GATE_PARAM = "gate.{key}"  # the summary run: one per policy key


def _templated(name: str) -> str:
    return name.replace("{", "<").replace("}", ">")


NAMES: dict[str, list[str]] = {
    "experiment": ["qeval/<model>"],
    "metrics": [
        *QUANTIZE_METRICS, *BENCH_METRICS, *SERVE_METRICS, *SIZE_METRICS, *GATE_METRICS,
        *(_templated(n) for n in (EVAL_METRIC, RECOVERY_METRIC, SERVED_METRIC)), "eval/<task>/<metric>_stderr",
        *(_templated(SERVED_DIFF).replace("<bound>", b) for b in ("", "_lower", "_upper")),
        *(f"size/<gpu>/{f}" for f in SIZE_GPU_FIGURES),
    ],
    "series": [*BENCH_SERIES, *SERVE_SERIES],
    "params": sorted({
        *QUANTIZE_SETTINGS.values(), *VERIFY_SETTINGS.values(), *EVAL_SETTINGS.values(), *ENGINE_SETTINGS.values(),
        *LOAD_SETTINGS.values(), *VLLM_SETTINGS.values(), *QUANTIZE_PARAMS, *EVAL_PARAMS, *BENCH_PARAMS,
        *SERVE_PARAMS, *SIZE_PARAMS,
        _templated(GATE_PARAM), PARAM_PRECISION,
    }),
    "tags": [
        TAG_DESCRIPTION, TAG_RUN_COLOUR,
        TAG_MODEL, TAG_PRECISION, TAG_KIND, TAG_SUPERSEDED, TAG_VERDICT, TAG_REASONS, TAG_CHOSEN, TAG_SHIPS,
        TAG_COMMIT, TAG_DIRTY, TAG_DIGESTS, *(_templated(t) for t in (TAG_STAGE, TAG_STAGE_ERROR)), TAG_VIEW,
    ],
}  # fmt: skip


def experiment_name(model: str) -> str:
    return NAMES["experiment"][0].replace("<model>", model)


def run_name(model: str, precision: str) -> str:
    return f"{model}@{precision}"


def summary_run_name(model: str) -> str:
    return f"{model}: gate and report"


def registered_model_name(model: str) -> str:
    return f"qeval-{model}"


# ---- typed results to MLflow names (pure) ------------------------------------------------------------


@dataclass
class Logged:
    """What one stage writes to its build's run."""

    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Metrics over a step (batch size, concurrency): name -> [(step, value), ...]."""
    params: dict[str, str] = field(default_factory=dict)
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _numbers(table: Mapping[str, Getter], obj: Any) -> dict[str, float]:
    values = {name: get(obj) for name, get in table.items()}
    return {k: float(v) for k, v in values.items() if v is not None and not isinstance(v, str)}


def _params(table: Mapping[str, Getter], obj: Any) -> dict[str, str]:
    values = {name: get(obj) for name, get in table.items()}
    return {k: _text(v) for k, v in values.items() if v is not None}


def _settings(config: Any, table: Mapping[str, str]) -> dict[str, str]:
    return {param: _text(getattr(config, name)) for name, param in table.items()} if config is not None else {}


def _finite(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if math.isfinite(v)}


def logged(result: StageResult) -> Logged:
    """The metrics, series, params and data sets a stage's result logs to its build's run."""
    match result:
        case Quantized():
            params = _settings(result.config, QUANTIZE_SETTINGS) | _settings(result.verify, VERIFY_SETTINGS)
            return Logged(_numbers(QUANTIZE_METRICS, result), params=params | _params(QUANTIZE_PARAMS, result))
        case Evaluated():
            metrics = {}
            for task, scores in result.accuracy.scores.items():
                for m in scores:
                    metrics[EVAL_METRIC.format(task=task, metric=m.id)] = m.value
                    if m.stderr is not None:
                        suffix = "" if m.filter == "none" else f"/{m.filter}"
                        metrics[EVAL_STDERR.format(task=task, name=m.name, filter=suffix)] = m.stderr
            for task, values in (result.recovery or {}).items():
                metrics |= {RECOVERY_METRIC.format(task=task, metric=k): v for k, v in values.items()}
            params = _settings(result.config, EVAL_SETTINGS) | _params(EVAL_PARAMS, result)
            return Logged(_finite(metrics), params=params, datasets=result.accuracy.datasets)
        case Benched():
            points = result.main_points()
            series = {n: [(p.batch, v) for p in points if (v := get(p)) is not None] for n, get in BENCH_SERIES.items()}
            params = _settings(result.config, ENGINE_SETTINGS) | _params(BENCH_PARAMS, result)
            return Logged(_numbers(BENCH_METRICS, result), series, params)
        case Served():
            levels = result.per_level.items()
            series = {
                n: [(c, float(v)) for c, m in levels if (v := get(m)) is not None] for n, get in SERVE_SERIES.items()
            }
            params = _settings(result.load, LOAD_SETTINGS) | _settings(result.vllm, VLLM_SETTINGS)
            return Logged(
                _numbers(SERVE_METRICS, result) | _served(result), series, params | _params(SERVE_PARAMS, result)
            )
        case Sized():
            metrics = _numbers(SIZE_METRICS, result)
            for f in result.fits:
                metrics |= {
                    SIZE_GPU_METRIC.format(gpu=f.gpu, figure=k): float(get(f)) for k, get in SIZE_GPU_FIGURES.items()
                }
            return Logged(metrics, params=_params(SIZE_PARAMS, result))
    raise TypeError(f"no MLflow mapping for {type(result).__name__}")


def _served(result: Served) -> dict[str, float]:
    """The build's scores through its server, and their paired difference from the offline ones."""
    if result.accuracy is None:
        return {}
    metrics = {
        SERVED_METRIC.format(task=task, metric=m.id): m.value
        for task, scores in result.accuracy.accuracy.scores.items()
        for m in scores
    }
    for task, c in result.accuracy.vs_offline.items():
        for bound, value in zip(("", "_lower", "_upper"), c.difference, strict=True):
            metrics[SERVED_DIFF.format(task=task, metric=c.metric, bound=bound)] = value
    return _finite(metrics)


def verdict_metrics(build: BuildVerdict) -> dict[str, float]:
    """A build's headline figures under the gate (`gate/*`), for the runs table: four significant digits,
    which is what a table cell shows whole (gate.json and the `eval/*` metrics keep every digit)."""
    return {k: float(f"{v:.4g}") for k, v in _finite(_numbers(GATE_METRICS, build)).items()}


def baseline_metrics(baseline: Measured) -> dict[str, float]:
    """The baseline's `gate/*` figures: recovery and speed-up 1 by definition."""
    build = BuildVerdict(precision="", verdict="", rules=[], tasks={}, speed=baseline, speedup=1.0)
    return verdict_metrics(build)


def verdict_tags(decision: Decision, build: BuildVerdict | None) -> dict[str, str]:
    """A build's verdict, its reasons (one per line) and its one-line summary as the run's description
    (None: the baseline); register_ship marks the chosen."""
    precision = build.precision if build else decision.policy.baseline  # the colour too, for runs made before it
    note = {TAG_DESCRIPTION: present.summary(decision, build), TAG_RUN_COLOUR: present.precision_colour(precision)}
    if build is None:
        return {TAG_VERDICT: "BASELINE", TAG_REASONS: "the baseline every build is compared with", **note}
    reasons = "\n".join(build.reasons)[:MAX_TAG]
    return {TAG_VERDICT: build.verdict, TAG_REASONS: reasons, TAG_CHOSEN: "false", **note}


def summary_tags(decision: Decision) -> dict[str, str]:
    ships = f"Ships {decision.chosen}: {decision.why}." if decision.chosen else f"Nothing ships: {decision.why}."
    return {TAG_SHIPS: decision.chosen or "none", TAG_DESCRIPTION: ships, **code_tags(decision.code)}


def decision_params(decision: Decision) -> dict[str, str]:
    """The policy the decision was made under, one `gate.<key>` param per policy key."""
    values = decision.policy.model_dump()
    return {
        GATE_PARAM.format(key=k): json.dumps(v) if isinstance(v, dict | list) else str(v) for k, v in values.items()
    }


def code_tags(code: CodeVersion) -> dict[str, str]:
    return {TAG_COMMIT: code.commit, TAG_DIRTY: str(code.dirty).lower()}


def stage_tags(stage: str, digest: str, code: CodeVersion, digests: str | None = None) -> dict[str, str]:
    """A finished stage's tags; `digests`: the run's TAG_DIGESTS so far, to which this stage's is added."""
    known = {**json.loads(digests or "{}"), stage: digest}
    return {TAG_STAGE.format(stage=stage): "done", TAG_DIGESTS: json.dumps(known, sort_keys=True), **code_tags(code)}


def stage_digest(tags: Mapping[str, str], stage: str) -> str | None:
    """The cache key a run's tags record for a finished stage."""
    return json.loads(tags.get(TAG_DIGESTS) or "{}").get(stage)


def build_run_tags(model: str, precision: str) -> dict[str, str]:
    return {TAG_MODEL: model, TAG_PRECISION: precision, TAG_RUN_COLOUR: present.precision_colour(precision)}


def runs_view() -> dict[str, Any]:
    """The runs page as a decision needs it, stored as MLflow's shared view (experiment tag TAG_VIEW) and
    opened by `view_url()`: the decision's columns in the table, and charts of quality against weights and
    speed. The keys are the UI's own view state (MLflow 3.17, experiment page: "selectedColumns",
    "compareRunCharts" with chart types SCATTER, BAR and PARALLEL)."""
    section = "qeval-decision"
    columns = [
        "attributes.`Description`",
        f"params.`{PARAM_PRECISION}`",
        f"tags.`{TAG_VERDICT}`",
        *(f"metrics.`{m}`" for m in ("gate/recovery_worst", "gate/recovery_worst_lower", "gate/weights_gb",
                                      "gate/speed", "gate/users_at_slo")),
    ]  # fmt: skip

    def chart(uuid: str, kind: str, name: str, **spec: Any) -> dict[str, Any]:
        return {"uuid": uuid, "type": kind, "displayName": name, "metricSectionId": section, "deleted": False,
                "isGenerated": False, "runsCountToCompare": 100, **spec}  # fmt: skip

    def axis(metric: str) -> dict[str, str]:
        return {"key": metric, "type": "METRIC"}

    charts = [
        chart("qeval-quality-weights", "SCATTER", "worst recovery against weights (GB)",
              xaxis=axis("gate/weights_gb"), yaxis=axis("gate/recovery_worst")),
        chart("qeval-quality-speed", "SCATTER", "worst recovery against the gate's speed figure",
              xaxis=axis("gate/speed"), yaxis=axis("gate/recovery_worst")),
        chart("qeval-users", "BAR", "concurrent users within the latency objective", metricKey="gate/users_at_slo"),
        chart("qeval-parallel", "PARALLEL", "precision, quality, weights, speed", selectedParams=[PARAM_PRECISION],
              selectedMetrics=["gate/recovery_worst", "gate/weights_gb", "gate/speed"]),  # every regime has these
    ]  # fmt: skip
    sections = [{"uuid": section, "name": "qeval: the decision", "display": True, "isReordered": True,
                 "deleted": False, "isGenerated": False}]  # fmt: skip
    fixed = ["attributes.`Run Name`", "runDateAndNestInfo", "duration"]  # the UI's own column ids
    return {
        "selectedColumns": columns,
        "columnOrder": fixed + columns,
        "columnWidths": {"attributes.`Description`": 380},  # the UI shows 50 characters of it
        "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": charts,
        "compareRunSections": sections,
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
    }


def view_url(base: str, experiment_id: str) -> str:
    """The runs table of an experiment with qeval's view, in the MLflow UI at `base`: the experiment's own
    page opens MLflow's GenAI overview; `workflowType=machine_learning` opens the runs table instead."""
    query = f"workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"
