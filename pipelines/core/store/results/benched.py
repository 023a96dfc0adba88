"""The bench stage's result: in-process generation over the card's grid, and what it logs."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from eval.bench.engine import EngineConfig, EngineResult, PointResult
from pipelines.core.store.results.base import Record, StageResult
from pipelines.core.store.results.logs import Getter, Logs, Settings
from quant.execution import Execution


class Speedup(Record):
    """Decode speed against the baseline's at the smallest batch, and whether the bytes explain it."""

    speedup_vs_baseline: float
    byte_ratio_vs_baseline: float = Field(description="baseline's resident weight bytes / this build's")
    speedup_suspect: bool = Field(description="faster than the byte ratio allows (with slack)")
    same_engine_as_baseline: bool = Field(description="measured with the baseline's harness (compiled or eager)")


METRICS: dict[str, Getter] = {
    "mem/weights_gb": lambda b: b.engine.weight_bytes / 1e9,
    "mem/kv_bytes_per_token": lambda b: b.engine.kv_bytes_per_token,
}
SERIES: dict[str, Getter] = {  # of a point, step = batch size, at the grid's main point
    "engine/ttft_ms": lambda p: p.ttft_ms_p50,
    "engine/decode_tps": lambda p: p.decode_tps_per_user,
    "engine/total_tps": lambda p: p.decode_tps_total,
    "engine/e2e_ms": lambda p: p.e2e_ms_p50,
    "engine/itl_ms": lambda p: p.itl_ms_p50,
    "engine/mbu": lambda p: p.mbu,
    "engine/total_chars_per_s": lambda p: p.chars_per_s_total,
    "mem/peak_gb": lambda p: p.peak_mem_bytes and p.peak_mem_bytes / 1e9,
}
PARAMS: dict[str, Getter] = {
    "engine.device": lambda b: b.engine.device_name,
    "engine.engine": lambda b: b.engine.engine,
    "engine.kernels": lambda b: b.engine.kernels,
    "engine.weights": lambda b: "random (no_weights)" if b.config.no_weights else "checkpoint",
    "engine.input_len": lambda b: b.input_len,
    "engine.output_len": lambda b: b.output_len,
    "engine.bandwidth_gb_s": lambda b: f"{b.engine.bandwidth_gb_s:.1f} ({b.engine.bandwidth_source})",
}
SETTINGS = Settings(
    EngineConfig,
    lambda b: b.config,
    {
        "no_weights": "engine.weights",
        **{
            name: f"engine.{name}"
            for name in (
                "batch_sizes",
                "input_lengths",
                "output_lengths",
                "warmup",
                "repeats",
                "device",
                "dtype",
                "compile",
                "kv_cache_dtype",
                "bandwidth_gb_s",
                "trust_remote_code",
                "seed",
            )
        },
    },
    {"checkpoint": "a path", "precision": "the run's tag"},
)


class Benched(StageResult):
    """In-process generation over the card's grid."""

    STAGE: ClassVar[str] = "bench"
    LOGS: ClassVar[Logs] = Logs(
        metrics=METRICS,
        params=PARAMS,
        settings=(SETTINGS,),
        points=lambda b: [(p.batch, p) for p in b.main_points()],
        series=SERIES,
    )

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
