"""`qeval run`: every stage, for every build of a card, in the registry's order, then the gate and the report.

quantize (every precision; the baseline only records its size), then evaluate, bench, size and serve
(every build; the server reads the offline evaluation and, on a GPU, the size stage's tensor-parallel
degree), then the gate and the report over all builds (pipelines/core/registry.py has the order). Each
build stage is cached, so a rerun costs seconds; the first stage that fails stops the run with its error,
and everything done before it stays. With a Ray address each build's stages run as one task instead
(pipelines/fanout.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pipelines.core.cards import ModelCard
from pipelines.core.errors import QevalError
from pipelines.core.registry import STAGES
from pipelines.core.results import StageRecord
from pipelines.core.tracker import Tracker
from pipelines.core.verdicts import Decision
from pipelines.decision.gate import gate
from pipelines.fanout import run_on_ray
from pipelines.present.report import report

log = logging.getLogger(__name__)


@dataclass
class PipelineResult:
    records: list[StageRecord]
    decision: Decision
    report_files: list[Path]


def builds_in_order(card: ModelCard) -> list[str]:
    """The card's builds, the baseline first: every other build's recovery and speed-up read it."""
    return [card.gate.baseline, *(p for p in card.precisions if p != card.gate.baseline)]


def run_pipeline(card: ModelCard, tracker: Tracker, *, force: bool = False, skip: tuple[str, ...] = (),
                 ray_address: str | None = None) -> PipelineResult:  # fmt: skip
    """Run the pipeline for one card; raise QevalError at the first stage that fails.

    `skip`: stages left out. `ray_address`: each build's stages as one task on that Ray cluster
    (pipelines/fanout.py); then a build that fails leaves the others' results, which are gated and
    reported before the error is raised."""
    builds = builds_in_order(card)
    stages = [s for s in STAGES if s not in skip]
    if ray_address:
        return _on_ray(card, tracker, builds, stages, ray_address, force)
    steps = [(stage, precision) for stage in stages for precision in builds]
    records = []
    for i, (stage, precision) in enumerate(steps, 1):
        log.info("[%d/%d] %s %s@%s", i, len(steps), stage, card.name, precision)
        records.append(STAGES[stage].load()(card, precision, tracker, force=force))
    return _decide(card, tracker, records)


def _decide(card: ModelCard, tracker: Tracker, records: list[StageRecord]) -> PipelineResult:
    log.info("gate %s", card.name)
    decision = gate(card, tracker)
    log.info("report %s", card.name)
    return PipelineResult(records, decision, report(card, decision, tracker))


def _on_ray(card: ModelCard, tracker: Tracker, builds: list[str], stages: list[str], address: str,
            force: bool) -> PipelineResult:  # fmt: skip
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
