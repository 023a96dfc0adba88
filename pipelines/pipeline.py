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
from pipelines.errors import QevalError
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


def run_pipeline(card: ModelCard, tracker: Tracker, *, force: bool = False, skip: tuple[str, ...] = (),
                 ray_address: str | None = None) -> PipelineResult:  # fmt: skip
    """Run the pipeline for one card; raise QevalError at the first stage that fails.

    `skip`: stages left out. `ray_address`: each build's stages as one task on that Ray cluster
    (pipelines/fanout.py); then a build that fails leaves the others' results, which are gated and
    reported before the error is raised."""
    builds = [card.gate.baseline, *(p for p in card.precisions if p != card.gate.baseline)]
    stages = [s for s in STAGES if s not in skip]
    if ray_address:
        return _on_ray(card, tracker, builds, stages, ray_address, force)
    steps = [(stage, precision) for stage in stages for precision in builds]
    records = []
    for i, (stage, precision) in enumerate(steps, 1):
        log.info("[%d/%d] %s %s@%s", i, len(steps), stage, card.name, precision)
        records.append(STAGES[stage](card, precision, tracker, force=force))
    return _decide(card, tracker, records)


def _decide(card: ModelCard, tracker: Tracker, records: list[StageRecord]) -> PipelineResult:
    log.info("gate %s", card.name)
    decision = gate(card, tracker)
    log.info("report %s", card.name)
    return PipelineResult(records, decision, report(card, decision, tracker))


def _on_ray(card: ModelCard, tracker: Tracker, builds: list[str], stages: list[str], address: str,
            force: bool) -> PipelineResult:  # fmt: skip
    from pipelines.fanout import run_on_ray

    outcomes = run_on_ray(card, builds, stages, address, force=force)
    records = [r for o in outcomes for r in o.records]
    failed = {o.precision: o.error for o in outcomes if o.error}
    if failed and (card.gate.baseline in failed or len(failed) == len(builds) - 1):
        raise QevalError(f"{card.name}: nothing to gate: " + "; ".join(f"{p}: {e}" for p, e in failed.items()))
    if not failed:
        return _decide(card, tracker, records)
    finished = card.model_copy(update={"precisions": [p for p in builds if p not in failed]})
    _decide(finished, tracker, records)
    log.info("gated and reported the builds that finished (%s)", ", ".join(finished.precisions))
    raise QevalError(f"{len(failed)} of {len(builds)} builds failed on Ray: "
                     + "; ".join(f"{card.name}@{p}: {e}" for p, e in failed.items()))  # fmt: skip
