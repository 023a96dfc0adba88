"""The size stage's result: memory and speed projected for the card's GPUs, and what it logs."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import ClassVar, Literal

from pydantic import Field

from eval.devices.sizing import Assumptions, Fit
from pipelines.core.store.results.base import Record, StageResult
from pipelines.core.store.results.logs import Getter, Logged, Logs, templated
from pipelines.core.store.results.shaped import DecodeCeiling


class BenchCheck(Record):
    """The projection for the bench's own device beside its measured decode speed (batch 1)."""

    decode_ceiling: float
    decode_measured: float
    measured_over_ceiling: float


METRICS: dict[str, Getter] = {
    "size/weights_gb": lambda s: s.weights_bytes / 1e9,
    "size/weights_gb_from_config": lambda s: s.weights_bytes_from_config / 1e9,
    "size/kv_bytes_per_token": lambda s: s.kv_bytes_per_token,
    "size/bench_device_decode_ceiling": lambda s: s.bench_check and s.bench_check.decode_ceiling,
    "size/bench_device_decode_measured": lambda s: s.bench_check and s.bench_check.decode_measured,
    "size/bench_device_measured_over_ceiling": lambda s: s.bench_check and s.bench_check.measured_over_ceiling,
    "size/shape_measured_over_ceiling": lambda s: s.shape_check and s.shape_check.measured_over_ceiling,
}
GPU_METRIC = "size/{gpu}/{figure}"
GPU_FIGURES: dict[str, Getter] = {  # size/<gpu>/<figure>, per target GPU
    "fits": lambda f: f.fits,
    "total_gb": lambda f: f.total_gb,
    "max_sequences": lambda f: f.max_sequences,
    "tensor_parallel": lambda f: f.tensor_parallel or 0,
    "decode_tps_ceiling": lambda f: f.decode_tps_per_user,
    "ttft_ms_floor": lambda f: f.ttft_ms,
}
PARAMS: dict[str, Getter] = {
    "size.grid": lambda s: f"batch {s.batch}, {s.input_len} in, {s.output_len} out",
    "size.gpus": lambda s: [f.gpu for f in s.fits],
    "size.group_size": lambda s: s.group_size,
    "size.weights": lambda s: s.weights_from,
    "size.assumptions": lambda s: json.dumps(asdict(s.assumptions)),
}


def _per_gpu(result: Sized) -> Logged:
    return Logged(
        {GPU_METRIC.format(gpu=f.gpu, figure=k): float(get(f)) for f in result.fits for k, get in GPU_FIGURES.items()}
    )


class Sized(StageResult):
    """Memory and speed projected for the card's GPUs."""

    STAGE: ClassVar[str] = "size"
    LOGS: ClassVar[Logs] = Logs(
        metrics=METRICS,
        params=PARAMS,
        more=_per_gpu,
        templates={"metrics": [templated(GPU_METRIC.replace("{figure}", f)) for f in GPU_FIGURES]},
    )

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
