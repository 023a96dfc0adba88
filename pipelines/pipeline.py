"""`qeval run`: every stage that exists, for every build of a card, in order.

Today that is the baseline build's accuracy; the quantize, bench, size, gate and report stages join
as they are built. Each stage is cached, so a rerun costs seconds.
"""

from __future__ import annotations

import logging

from pipelines.cards import ModelCard
from pipelines.evaluate import evaluate
from pipelines.stages import StageRecord
from pipelines.tracking import Tracker

log = logging.getLogger(__name__)


def run_pipeline(card: ModelCard, tracker: Tracker, *, force: bool = False) -> list[StageRecord]:
    """Run the pipeline for one card; raise QevalError at the first stage that fails."""
    records = []
    stages = [("evaluate", card.gate.baseline)]
    for i, (stage, precision) in enumerate(stages, 1):
        log.info("[%d/%d] %s %s@%s", i, len(stages), stage, card.name, precision)
        records.append(evaluate(card, precision, tracker, force=force))
    return records
