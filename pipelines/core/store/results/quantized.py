"""The quantize stage's result: a build's checkpoint, built and proven, and what it logs."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from pipelines.core.store.layout import CHECKPOINT_DIR
from pipelines.core.store.results.base import StageResult
from pipelines.core.store.results.logs import Getter, Logs, Settings
from pipelines.core.system.integrity import differences, hashes_digest
from quant.build import QuantizeConfig, QuantizeResult
from quant.precisions import get_precision
from quant.verify import VerifyConfig, VerifyResult


def _grouped(q: Quantized) -> bool:
    return q.config is not None and get_precision(q.config.precision).grouped


METRICS: dict[str, Getter] = {
    "size/checkpoint_gb": lambda q: q.checkpoint_bytes / 1e9,
    "quant/kl_vs_baseline": lambda q: q.proof and q.proof.kl_vs_baseline,
    "quant/top1_agreement": lambda q: q.proof and q.proof.top1_agreement,
    "quant/seconds": lambda q: q.build and q.build.seconds,
    "quant/peak_rss_gb": lambda q: q.build and q.build.peak_rss_mb * 2**20 / 1e9,
}
PARAMS: dict[str, Getter] = {  # derived from the result; override a setting of the same name
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
# every setting that changes a result is a param; the fields that are not, and why
SETTINGS = (
    Settings(
        QuantizeConfig,
        lambda q: q.config,
        {
            "group_size": "quant.group_size",
            "ignore": "quant.ignore",
            "calibration": "quant.calibration",
            "trust_remote_code": "quant.trust_remote_code",
            "seed": "quant.seed",
            "dtype": "quant.dtype",
        },
        {
            "base": "a path; its digest is in the cache key",
            "precision": "the run's tag",
            "target_modules": "a mix's layers, in its manifest (quant.fallback_layers counts those kept)",
            "fallback_modules": "quant.fallback_layers",
        },
    ),
    Settings(
        VerifyConfig,
        lambda q: q.verify,
        {"max_tokens": "quant.verify_max_tokens", "min_agreement": "quant.verify_min_agreement"},
        {
            "base": "a path",
            "checkpoint": "a path",
            "precision": "the run's tag",
            "trust_remote_code": "quant.trust_remote_code",
            "dtype": "quant.dtype",
            "device": "where both models ran: the stage's environment (the GPU's name, or the CPU) says",
            "layer_formats": "a mix's layers, as the quantize stage names them (quant.fallback_layers)",
        },
    ),
)


class Quantized(StageResult):
    """A build's checkpoint: built and proven by llm-compressor, or the baseline's own weights."""

    STAGE: ClassVar[str] = "quantize"
    # the checkpoint goes to a shared store too, where another machine pulls it from; in a store on this machine
    # only the build that ships is (the gate logs it: the registry's `ship` points at it)
    KEPT_LOCALLY: ClassVar[tuple[str, ...]] = (CHECKPOINT_DIR,)
    CHECKS_ITSELF: ClassVar[tuple[str, ...]] = (CHECKPOINT_DIR,)
    LOGS: ClassVar[Logs] = Logs(metrics=METRICS, params=PARAMS, settings=SETTINGS)

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
