"""The sensitivity stage's result (pipelines/stages/sensitivity.py): a precision's layer groups ranked by what
quantizing each alone costs, and the frontier of mixed builds it predicts."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from pipelines.core.store.results.base import Record, StageResult
from pipelines.core.store.results.logs import Getter, Logged, Logs


class RankedGroup(Record):
    """A layer group's cost when it alone is quantized (quant/sensitivity.py)."""

    group: str
    modules: list[str]
    parameters: int = Field(description="weights of its layers")
    kl: float = Field(description="mean KL divergence per token from the baseline, nats")


class Candidate(Record):
    """A mixed build on the predicted frontier, known before it is built."""

    kept: int = Field(description="the most sensitive groups kept at the fallback")
    precision: str = Field(description="its name (quant/precisions.py, MIX_FORM); the uniform builds at the ends")
    weight_bytes: float = Field(description="projected bytes of its weights")
    effective_bits: float = Field(description="bits per weight over its quantized layers, scales included")
    predicted_kl: float = Field(description="KL divergence with its layers quantized to nearest, nats per token")


METRICS: dict[str, Getter] = {  # on its target's run
    "sensitivity/top_half_kl": lambda r: r.top_half_kl,
    "sensitivity/bottom_half_kl": lambda r: r.bottom_half_kl,
    "sensitivity/tokens": lambda r: r.tokens,
}
PARAMS: dict[str, Getter] = {
    "sensitivity.fallback": lambda r: r.fallback,
    "sensitivity.ranking": lambda r: [g.group for g in r.ranked][:40],
}
SERIES = {  # name -> its step: the rank of a group (0: the most sensitive), or the groups a mix keeps
    "sensitivity/kl_by_rank": "rank",
    "search/predicted_kl": "kept",
    "search/projected_weights_gb": "kept",
}


def _series(result: Ranked) -> Logged:
    kl, predicted, projected = SERIES
    return Logged(
        series={
            kl: [(i, g.kl) for i, g in enumerate(result.ranked)],
            predicted: [(c.kept, c.predicted_kl) for c in result.frontier],
            projected: [(c.kept, c.weight_bytes / 1e9) for c in result.frontier],
        }
    )


class Ranked(StageResult):
    """The layer groups of a precision's build ranked by sensitivity, and the frontier of mixed builds."""

    STAGE: ClassVar[str] = "sensitivity"
    LOGS: ClassVar[Logs] = Logs(metrics=METRICS, params=PARAMS, more=_series, templates={"series": SERIES})

    precision: str = Field(description="the precision most layers go to")
    fallback: str = Field(description="the one the most sensitive groups keep")
    scheme: str
    tokens: int = Field(description="calibration tokens every divergence is averaged over")
    ranked: list[RankedGroup] = Field(description="most sensitive first")
    top_half_kl: float = Field(description="the most sensitive half of the groups quantized at once")
    bottom_half_kl: float = Field(description="the least sensitive half")
    frontier: list[Candidate] = Field(description="by groups kept, from none (the uniform build) to all")

    def modules(self, kept: int) -> tuple[list[str], list[str]]:
        """(the layers at the precision, the layers kept at the fallback) of the mix keeping `kept` groups."""
        if not 0 < kept < len(self.ranked):
            raise ValueError(f"a mix keeps 1 to {len(self.ranked) - 1} of {len(self.ranked)} groups, not {kept}")
        return [m for g in self.ranked[kept:] for m in g.modules], [m for g in self.ranked[:kept] for m in g.modules]

    def headline(self) -> str:
        top = self.ranked[0]
        return (
            f"{len(self.ranked)} groups, most sensitive {top.group} ({top.kl:.2e} nats); halves "
            f"{self.top_half_kl:.2e} vs {self.bottom_half_kl:.2e}"
        )
