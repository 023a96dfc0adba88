"""The gate: which quantized build ships, under the policy in the model card (`gate:`).

Per build and task, a paired comparison with the baseline on the same documents (eval/quality/paired.py)
gives an interval on recovery (or on the perplexity increase) and a verdict: PASS, FAIL or
INCONCLUSIVE. A generative task's output length is held within a band around the baseline's (the length
rule), and where greedy outputs first depart from the baseline's is recorded. The speed rule compares the
policy's speed figure with the baseline's; the memory rule compares peak memory with the budget
(policy.py). A build passes only when every rule passes; among passing builds the policy's preference
picks the one that ships.

With `against="ship"` every build is also compared with the build that alias `ship` points at, on its
per-document records from MLflow, with the same statistics and thresholds: a rebuild worse than what is
deployed fails (a regression gate for CI).

The gate reads the stages from the tracking store where this machine lacks them
(pipelines/tracking/readback.py). The result goes to artifacts/<model>/gate.json, to tags
`qeval.gate.verdict` and `qeval.gate.reasons` on every build's MLflow run, and to the Model Registry:
`qeval-<model>`, alias `ship`, whose version's source is the chosen build's checkpoint logged on its
run, so that any machine reaching the store can fetch it (`qeval pull`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from eval.quality.paired import Generation, Scored
from eval.quality.stats import Comparison, Verdict
from pipelines.core.card.cards import ModelCard, load_card
from pipelines.core.framework.code import code_version
from pipelines.core.framework.registry import stale_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import checkpoint_for
from pipelines.core.store.layout import CHECKPOINT_DIR, stage_dir
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Evaluated, Quantized
from pipelines.core.store.searches import with_carried
from pipelines.core.store.verdicts import BuildVerdict, Decision, Measured, Rule, write_decision
from pipelines.core.system.errors import QevalError
from pipelines.core.system.integrity import Tampered
from pipelines.decision.inputs import (
    answer_flips,
    fits,
    generations,
    measured,
    not_scored,
    paired_with,
    task_comparisons,
)
from pipelines.decision.policy import (
    choose,
    combine,
    cost_rule,
    fit_rule,
    length_rule,
    memory_rule,
    speed_label,
    speed_rule,
    task_rule,
    vs_ship_rule,
)
from pipelines.tracking.names import SHIP_ALIAS as SHIP
from pipelines.tracking.readback import fetch_builds, fetch_shipped, logged_result
from quant.precisions import get_precision

Shipped = tuple[str, tuple[Scored, Evaluated]]  # the shipped version's name, and its evaluation
ShipCard = Callable[[ModelCard, Decision], str | None]

log = logging.getLogger(__name__)


def judge(
    card: ModelCard,
    precision: str,
    baseline: Measured,
    baseline_bytes: float,
    shipped: Shipped | None = None,
) -> BuildVerdict:
    """Every rule of the card's policy applied to one quantized build; with `shipped` (the name and the
    evaluation of the build alias `ship` points at), its tasks against that build's too."""
    policy = card.gate
    q = quality(card, precision)
    vs_ship = paired_with(card, precision, shipped[1]) if shipped else {}
    build, weight_bytes = measured(card, precision)
    rules = list(q.rules)
    rules += [vs_ship_rule(shipped[0], t, c) for t, c in vs_ship.items()] if shipped else []
    fast, up = speed_rule(policy, build, baseline, baseline_bytes / weight_bytes)
    rules += [fast, memory_rule(policy, build)]
    if card.traffic is not None:
        rules.append(cost_rule(policy, build))
    if policy.must_fit:
        rules.append(fit_rule(fits(card, precision)))
    return BuildVerdict(
        precision=precision,
        verdict=combine([r.verdict for r in rules]),
        rules=rules,
        tasks=q.tasks,
        speed=build,
        speedup=up,
        vs_ship=vs_ship,
        generation=q.generation,
        not_scored=q.not_scored,
        flips=answer_flips(card, precision),
    )


@dataclass(frozen=True)
class Quality:
    """A build's quality against the baseline, as the gate judges it: its task, length and not-scored rules."""

    verdict: Verdict
    rules: list[Rule]
    tasks: dict[str, Comparison]
    generation: dict[str, Generation]
    not_scored: dict[str, str]


def quality(card: ModelCard, precision: str) -> Quality:
    """The gate's quality rules alone, for a build that has only been evaluated (the mixed-precision search's
    judge: speed, memory and cost do not depend on which layers a mix keeps)."""
    tasks: dict[str, Comparison] = task_comparisons(card, precision)
    generated = generations(card, precision)
    rules = [task_rule(t, c) for t, c in tasks.items()]
    rules += [length_rule(card.gate, t, g.length) for t, g in generated.items()]
    unscored = not_scored(card, precision)
    # a task left unscored cannot pass: the build cannot ship, whatever its scored tasks say
    rules += [Rule(t, Verdict.INCONCLUSIVE, f"{t}: not scored ({why})") for t, why in unscored.items()]
    return Quality(combine([r.verdict for r in rules]), rules, tasks, generated, unscored)


def decide(card: ModelCard, shipped: Shipped | None = None, against: dict[str, str] | None = None) -> Decision:
    """Apply the card's policy to the finished stages of every build (and compare each with `shipped`)."""
    policy = card.gate
    baseline, baseline_bytes = measured(card, policy.baseline)
    verdicts = [judge(card, p, baseline, baseline_bytes, shipped) for p in card.precisions if p != policy.baseline]
    chosen, why = choose(verdicts, policy.prefer, policy.tie_tolerance)
    return Decision(
        model=card.name,
        decided=datetime.now(UTC).isoformat(timespec="seconds"),
        policy=policy,
        speed_axis=speed_label(card),
        baseline=baseline,
        builds=verdicts,
        chosen=chosen,
        why=why,
        against=against or {},
        code=code_version(),
    )


def _shipped(card: ModelCard, tracker: Tracker) -> tuple[Shipped | None, dict[str, str]]:
    """The evaluation of the build alias `ship` points at, for a regression gate; None when nothing ships."""
    found = fetch_shipped(card, tracker)
    if found is None:
        log.warning("%s: no build ships yet (alias 'ship' is unset): gating against the baseline only", card.name)
        return None, {}
    info, evaluation = found
    return (f"ship v{info['version']} ({info['precision']})", evaluation), info


def checkpoint_source(card: ModelCard, tracker: Tracker, precision: str, run_id: str) -> str:
    """The chosen build's checkpoint as an artifact of its run, logged now where the quantize stage did not
    (a store made before checkpoints were logged): the registry version's source, fetchable anywhere."""
    where = f"{Quantized.STAGE}/{CHECKPOINT_DIR}"
    if not tracker.has_artifacts(run_id, where):
        try:
            folder, _ = checkpoint_for(card, precision)
        except QevalError:
            raise QevalError(
                f"gate: {card.name}@{precision}: its run {run_id} has no logged checkpoint and this machine has "
                f"none; rerun on the machine that built it, or: qeval quantize --model {card.name} "
                f"--precision {precision} --force"
            ) from None
        tracker.log_folder(run_id, Path(folder), where)
    return tracker.artifact_uri(run_id, where)


def _check_stages(card: ModelCard) -> None:
    """Every quantized checkpoint this machine holds is the one its quantize stage built and checked (a Tampered
    error otherwise), and every stage of a build is as it finished, having measured the weights its checkpoint
    holds now (a QevalError naming the command that runs it again otherwise): the gate judges those bytes, and
    registers them."""
    for precision in card.precisions:
        built = get_precision(precision).shares or precision
        current = None  # not built on this machine: its stages come from the store, with their own record
        if built == card.gate.baseline or (stage_dir(card.name, built, Quantized.STAGE) / CHECKPOINT_DIR).is_dir():
            try:  # a hub model's weights are named by id and revision: nothing to fetch for that
                hub = built == card.gate.baseline and card.source.path is None
                current = card.source.location if hub else checkpoint_for(card, precision)[1]
            except Tampered:
                raise
            except QevalError:
                pass  # the base weights are not on this machine
        if problem := stale_stage(card, precision, current):
            raise QevalError(f"gate: {problem}")


def gate(card: ModelCard, tracker: Tracker, *, ship_card: ShipCard, against: str | None = None) -> Decision:
    """Decide, then record the decision: gate.json, MLflow tags, and the registry alias `ship`.

    `ship_card` writes the chosen build's card from the decision (pipelines/present/shipcard.py: the caller hands
    it in, so that the decision hands its data to what presents it); `against="ship"`: a regression gate, every
    build also compared with the build that ships now."""
    fetch_builds(card, tracker)
    _check_stages(card)
    shipped, info = _shipped(card, tracker) if against == SHIP else (None, {})
    decision = decide(card, shipped, info)
    for b in decision.builds:
        log.info("%s@%s: %s", card.name, b.precision, b.verdict)
        for r in b.rules:
            log.debug("    %s", r.reason)
    tracker.log_verdicts(decision)
    if decision.chosen:
        run_id = tracker.build_run(decision.chosen)
        source = checkpoint_source(card, tracker, decision.chosen, run_id)
        # its files as built: from this machine's quantize stage, else from its run (a gate on an empty folder)
        built = result_of(card.name, decision.chosen, Quantized) or logged_result(tracker, run_id, Quantized)
        files = built.files if built else None
        registered = tracker.register_ship(run_id, source, decision.why, ship_card(card, decision) or "", files)
        decision = decision.model_copy(update={"registered": registered})
        log.info("%s: ships %s (%s)", card.name, decision.chosen, decision.why)
    elif shipped:  # a regression gate that nothing passed: what is deployed stays deployed
        log.warning("%s: nothing replaces %s: %s", card.name, shipped[0], decision.why)
    elif (
        (now := tracker.shipped()) is not None
        and now["precision"] not in card.precisions
        and (not now["precision"] or now["precision"] in _still_listed(card))
    ):
        # a gate of some builds (qeval gate --precision) un-ships only a build it judged; a version qeval did not
        # register (no precision on its run) is not one
        kept = now["precision"] or f"version {now['version']}"
        log.warning(
            "%s: nothing of %s ships (%s); %s still ships, not judged here",
            card.name,
            ", ".join(card.precisions),
            decision.why,
            kept,
        )
    else:  # nothing the card builds passed, or what ships is no longer among its builds: the alias goes
        tracker.clear_ship()
        log.warning("%s: nothing ships: %s", card.name, decision.why)
    tracker.log_decision(decision, write_decision(decision))
    return decision


def _still_listed(card: ModelCard) -> set[str]:
    """The builds the card lists on disk (with its search's carried mix) besides those judged now: a build outside
    them can no longer ship, and the alias is not left on it."""
    try:
        listed = with_carried(load_card(card.name)).precisions
    except QevalError:
        listed = []
    return {*listed, *card.precisions}


def nothing_to_gate(card: ModelCard, tracker: Tracker, why: str) -> str:
    """A card whose quality was not measured (its weights were not had): nothing is judged, so alias `ship` stays
    where the last gate put it; returns the reason, as the report and the command line say it."""
    reason = f"its quality needs the model's weights and none were evaluated here ({why})"
    if now := tracker.shipped():
        reason += f"; {now['precision'] or 'version ' + str(now['version'])} still ships, from an earlier gate"
    log.warning("%s: nothing judged: %s", card.name, reason)
    return reason
