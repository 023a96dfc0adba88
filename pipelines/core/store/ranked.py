"""The sensitivity stage's result (pipelines/stages/sensitivity.py): a precision's layer groups ranked by what
quantizing each alone costs, and the frontier of mixed builds it predicts."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from pipelines.core.store.results import Record, StageResult


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


class Ranked(StageResult):
    """The layer groups of a precision's build ranked by sensitivity, and the frontier of mixed builds."""

    STAGE: ClassVar[str] = "sensitivity"

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
