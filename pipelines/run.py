"""`qeval run`: every stage, for every build of a card, in the registry's order, then the gate and the report.

quantize (every precision; the baseline only records its size), then evaluate, bench, size and serve
(every build; the server reads the offline evaluation and, on a GPU, the size stage's tensor-parallel
degree; pipelines/core/framework/registry.py has the order); where the card has a `search:` section, the
mixed-precision search (pipelines/search.py) and every stage for the mix it carries on; then the gate and the
report over all builds. Each build stage is cached, so a rerun costs seconds; the first stage that fails stops
the run with its error, and everything done before it stays. With a Ray address each build's stages run as one
task instead (pipelines/fanout.py), and the search is left to `qeval search`.

A card whose base weights cannot be had here (not in the local cache, the hub not reachable), or a run
asked for its speed half alone (`--speed-half`), runs the stages that need no weights instead: every
precision timed at the model's shape with random weights (the shape stage), and sized. Its quality needs
the weights, so nothing ships, and the run says so in one line and in the report.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.core.card.cards import ModelCard
from pipelines.core.framework.registry import FULL_RUN, SPEED_HALF, STAGES
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import WeightsRefused, resolve_weights
from pipelines.core.store.manifests import StageRecord
from pipelines.core.store.searches import Searched
from pipelines.core.store.verdicts import Decision
from pipelines.core.system.errors import QevalError
from pipelines.decision.gate import gate, nothing_to_gate
from pipelines.fanout import run_on_ray
from pipelines.present.report import report, speed_report
from pipelines.present.shipcard import ship_card

log = logging.getLogger(__name__)


@dataclass
class PipelineResult:
    records: list[StageRecord]
    decision: Decision | None  # None: the speed half ran alone, and nothing was gated
    report_files: list[Path]
    speed_half: str | None = None  # why only the speed half ran
    # wall seconds this run spent per stage (every build together), the gate, the report, and in all
    seconds: dict[str, float] = field(default_factory=dict)
    search: Searched | None = None  # the mixed-precision search, where the card asks for one


def weights_missing(card: ModelCard) -> str | None:
    """Why the card's base weights cannot be had here (one line), or None where they can. A hub that refuses
    them (gated without access, no such repository) is an error, raised: the speed half is for weights this
    machine cannot reach, not for a card that names weights it may not have."""
    try:
        resolve_weights(card)
    except WeightsRefused:
        raise
    except QevalError as e:
        return str(e)
    return None


def builds_in_order(card: ModelCard) -> list[str]:
    """The card's builds, the baseline first: every other build's recovery and speed-up read it."""
    return [card.gate.baseline, *(p for p in card.precisions if p != card.gate.baseline)]


def run_pipeline(
    card: ModelCard,
    tracker: Tracker,
    *,
    force: bool = False,
    skip: tuple[str, ...] = (),
    ray_address: str | None = None,
    speed_half: bool = False,
) -> PipelineResult:
    """Run the pipeline for one card; raise QevalError at the first stage that fails.

    `skip`: stages left out. `ray_address`: each build's stages as one task on that Ray cluster
    (pipelines/fanout.py); then a build that fails leaves the others' results, which are gated and
    reported before the error is raised. `speed_half`: only the stages that need no weights (also what
    runs when the weights cannot be had)."""
    t0 = time.perf_counter()
    builds = builds_in_order(card)
    why = "its speed half was asked for alone (--speed-half)" if speed_half else weights_missing(card)
    if why is None and "evaluate" not in skip:
        from pipelines.stages.evaluate import check_where_scored

        check_where_scored(card)  # before a build is made: the engine's Python can load every task
    if why is not None:
        result = _speed_half(card, tracker, builds, [s for s in SPEED_HALF if s not in skip], why, force)
    elif ray_address:
        result = _on_ray(card, tracker, builds, [s for s in FULL_RUN if s not in skip], ray_address, force)
    else:
        seconds: dict[str, float] = defaultdict(float)
        stages = [s for s in FULL_RUN if s not in skip]
        records = _in_order(card, tracker, builds, stages, force, seconds)
        found = None
        if searching(card, skip):
            card, found, more = _search(card, tracker, stages, force, seconds)
            records += more
        result = _decide(card, tracker, records, seconds)
        result.search = found
    result.seconds["total"] = time.perf_counter() - t0
    return result


def _in_order(
    card: ModelCard, tracker: Tracker, builds: list[str], stages: list[str], force: bool, seconds: dict[str, float]
) -> list[StageRecord]:
    """Each stage for every build, stage by stage, one at a time on this machine; adds each stage's wall
    time (its cache checks included) to `seconds`."""
    steps = [(stage, precision) for stage in stages for precision in builds]
    records = []
    for i, (stage, precision) in enumerate(steps, 1):
        log.info("[%d/%d] %s %s@%s", i, len(steps), stage, card.name, precision)
        t0 = time.perf_counter()
        records.append(STAGES[stage].load()(card, precision, tracker, force=force))
        seconds[stage] += time.perf_counter() - t0
    return records


def searching(card: ModelCard, skip: tuple[str, ...]) -> bool:
    """Whether the run searches for a mixed build: the card has a search whose precisions it builds, and its
    ranking (the sensitivity stage) is not skipped."""
    s = card.search
    return s is not None and "sensitivity" not in skip and {s.target, s.fallback} <= set(card.precisions)


def _search(
    card: ModelCard, tracker: Tracker, stages: list[str], force: bool, seconds: dict[str, float]
) -> tuple[ModelCard, Searched, list[StageRecord]]:
    """The mixed-precision search, then every stage for the mix it carries on (the one that passes with the
    fewest bytes, else the last it tried): the card with that build added, and its stages' records."""
    from pipelines.search import search, with_build

    log.info(
        "search %s: %s with its most sensitive layer groups at %s", card.name, card.search.target, card.search.fallback
    )
    t0 = time.perf_counter()
    found = search(card, tracker, force=force)
    seconds["search"] += time.perf_counter() - t0
    if found.carried is None:
        return card, found, []
    mixed = with_build(card, found.carried)
    return mixed, found, _in_order(mixed, tracker, [found.carried], stages, force, seconds)


def _speed_half(
    card: ModelCard, tracker: Tracker, builds: list[str], stages: list[str], why: str, force: bool
) -> PipelineResult:
    """The stages that need no weights, for every build; nothing is gated, and the report says why."""
    log.warning(
        "%s: running its speed half only (%s): %s at the model's shape with random weights, and sizing; "
        "its quality needs the weights, so nothing is judged and what ships stays as it is",
        card.name,
        why,
        ", ".join(builds),
    )
    seconds: dict[str, float] = defaultdict(float)
    records = _in_order(card, tracker, builds, stages, force, seconds)
    t0 = time.perf_counter()
    reason = nothing_to_gate(card, tracker, why)
    files = speed_report(card, reason, tracker)
    seconds["report"] = time.perf_counter() - t0
    return PipelineResult(records, None, files, speed_half=reason, seconds=seconds)


def _decide(
    card: ModelCard, tracker: Tracker, records: list[StageRecord], seconds: dict[str, float] | None = None
) -> PipelineResult:
    seconds = defaultdict(float, seconds or {})
    log.info("gate %s", card.name)
    t0 = time.perf_counter()
    decision = gate(card, tracker, ship_card=ship_card)
    seconds["gate"] = time.perf_counter() - t0
    log.info("report %s", card.name)
    files = report(card, decision, tracker)
    seconds["report"] = time.perf_counter() - t0 - seconds["gate"]
    return PipelineResult(records, decision, files, seconds=seconds)


def _on_ray(
    card: ModelCard, tracker: Tracker, builds: list[str], stages: list[str], address: str, force: bool
) -> PipelineResult:
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
    raise QevalError(
        f"{len(failed)} of {len(builds)} builds failed on Ray: "
        + "; ".join(f"{card.name}@{p}: {e}" for p, e in failed.items())
    )
