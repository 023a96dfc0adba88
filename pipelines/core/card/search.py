"""A card's mixed-precision search (`search:`; pipelines/search.py runs it): which precision most layers go to,
which one the most sensitive layer groups keep, and how much the search may spend."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from eval.quality.paired import Bootstrap
from pipelines.core.card.names import PrecisionName
from quant.precisions import get_precision, mix_name

ModelCard = Any  # pipelines/core/card/cards.py's, which imports this module


class Search(BaseModel):
    """Most layers at `target`, the most sensitive layer groups kept at `fallback`: the fewest kept that the gate's
    quality verdict passes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: PrecisionName = Field(description="the precision most layers go to (one of the card's: fp8, int8 or gptq)")
    fallback: PrecisionName = Field(
        description="the wider precision the most sensitive groups keep (the card's, or bf16)"
    )
    max_evaluations: PositiveInt = Field(3, description="mixed builds the search may build and evaluate, at most")
    max_weight_gb: float | None = Field(
        None, gt=0, description="candidates whose projected weights exceed this are not tried (null: no budget)"
    )
    max_effective_bits: float | None = Field(
        None, gt=0, le=16, description="nor those whose quantized layers average more bits per weight than this"
    )
    samples: PositiveInt | None = Field(
        None, description="calibration samples the sensitivity ranking reads (null: the calibration section's)"
    )


def search_problem(card: ModelCard, search: Search) -> str | None:
    """What is wrong with a card's search, given the rest of the card (None: nothing)."""
    if search.target not in card.precisions or search.target == card.gate.baseline:
        return f"target '{search.target}' is not among the card's quantized precisions"
    if search.fallback not in card.precisions:
        return f"fallback '{search.fallback}' is not among precisions {card.precisions}"
    try:
        get_precision(mix_name(search.target, 1, search.fallback))
    except ValueError as e:
        return str(e)
    if card.calibration is None:
        return "ranking the layers needs a calibration section"
    return None


def fallback_of(card: ModelCard, precision: str) -> str:
    """What a precision's most sensitive layer groups are kept at: the card's `search.fallback` where the precision
    is its target, else the baseline."""
    s = card.search
    return s.fallback if s is not None and s.target == precision else card.gate.baseline


def judging(card: ModelCard) -> Bootstrap:
    """How a card's paired verdicts are drawn: its gate's, the chance of a wrong PASS split evenly (Bonferroni) over
    every build it can judge, its quantized precisions and the search's mixes, so that the chance that any build
    judged passes while worse than a threshold is at most 1 - confidence (docs/gate.md)."""
    mixes = card.search.max_evaluations if card.search else 0
    return card.gate.judging(len(card.precisions) - 1 + mixes)
