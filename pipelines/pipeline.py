"""`qeval run`: every stage that exists, for every build of a card, in order.

quantize (every precision; the baseline only records its size), then evaluate, bench, size and
serve (every build; the server reads the offline evaluation and, on a GPU, the size stage's tensor-parallel
degree), then the gate and the report over all builds. Each build stage is cached, so a
rerun costs seconds; the first stage that fails stops the run with its error, and everything done
before it stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipelines.bench import bench
from pipelines.cards import ModelCard
from pipelines.evaluate import evaluate
from pipelines.gate import gate
from pipelines.quantize import quantize
from pipelines.report import report
from pipelines.results import Decision
from pipelines.serve_bench import serve_bench
from pipelines.size import size
from pipelines.stages import StageRecord
from pipelines.tracking import Tracker

log = logging.getLogger(__name__)

STAGES: dict[str, Callable[..., StageRecord]] = {
    "quantize": quantize,
    "evaluate": evaluate,
    "bench": bench,
    "size": size,
    "serve": serve_bench,
}


@dataclass
class PipelineResult:
    records: list[StageRecord]
    decision: Decision
    report_files: list[Path]


def run_pipeline(card: ModelCard, tracker: Tracker, *, force: bool = False) -> PipelineResult:
    """Run the pipeline for one card; raise QevalError at the first stage that fails."""
    builds = [card.gate.baseline, *(p for p in card.precisions if p != card.gate.baseline)]
    steps = [(stage, precision) for stage in STAGES for precision in builds]
    records = []
    for i, (stage, precision) in enumerate(steps, 1):
        log.info("[%d/%d] %s %s@%s", i, len(steps), stage, card.name, precision)
        records.append(STAGES[stage](card, precision, tracker, force=force))
    log.info("gate %s", card.name)
    decision = gate(card, tracker)
    log.info("report %s", card.name)
    return PipelineResult(records, decision, report(card, decision, tracker))
