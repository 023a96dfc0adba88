"""The gate: which quantized build ships, under the policy in the model card (`gate:`).

Per build and task, a paired comparison with the baseline on the same documents (eval/stats.py)
gives an interval on recovery (or on the perplexity increase) and a verdict: PASS, FAIL or
INCONCLUSIVE. The speed rule compares decode tokens/s per user at the policy's batch size with the
baseline's; the memory rule compares peak memory there with the budget. A build passes only when
every rule passes; among passing builds the policy's preference picks the one that ships.

With `against="ship"` every build is also compared with the build that alias `ship` points at, on its
per-document records from MLflow, with the same statistics and thresholds: a rebuild worse than what is
deployed fails (a regression gate for CI).

The gate reads the stages from the tracking store where this machine lacks them (pipelines/sync.py). The
result goes to artifacts/<model>/gate.json, to tags `qeval.gate.verdict` and `qeval.gate.reasons` on
every build's MLflow run, and to the Model Registry: `qeval-<model>`, alias `ship`, whose version's
source is the chosen build's checkpoint logged on its run, so that any machine reaching the store can
fetch it (`qeval pull`).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

from eval import speed as speed_math
from eval.sizing import Fit
from eval.stats import Comparison
from pipelines.cards import Gate, ModelCard
from pipelines.errors import QevalError
from pipelines.gate_inputs import Evaluation, fits, measured, paired_with, task_comparisons
from pipelines.mlflow_names import SHIP_ALIAS as SHIP
from pipelines.results import (
    FAIL,
    INCONCLUSIVE,
    NOT_GATED,
    PASS,
    BuildVerdict,
    Decision,
    Measured,
    Quantized,
    Rule,
    checkpoint_for,
    write_decision,
)
from pipelines.stages import code_version
from pipelines.sync import fetch_builds, fetch_shipped
from pipelines.tracking import Tracker
from quant.build import CHECKPOINT_DIR

log = logging.getLogger(__name__)


def speed_label(card: ModelCard) -> str:
    """What the speed figures of the decision are, under the policy's regime."""
    if card.gate.speed_regime == "server":
        return f"goodput, requests/s within the SLO at {card.judged_users} users"
    return f"decode tokens/s per user at batch {card.gate.speed_batch}"


# ---- the policy, as pure functions -------------------------------------------------------------


def combine(verdicts: list[str]) -> str:
    """A build's verdict from its rules': any FAIL fails, else any INCONCLUSIVE, else PASS."""
    if FAIL in verdicts:
        return FAIL
    if INCONCLUSIVE in verdicts:
        return INCONCLUSIVE
    return PASS


def task_rule(task: str, c: Comparison) -> Rule:
    est, lo, hi = c.statistic
    if c.rule == "recovery":
        text = f"{task}: {c.metric} recovery {est:.4f} [{lo:.4f}, {hi:.4f}] vs min {c.threshold:g}"
    else:
        text = f"{task}: {c.metric} perplexity {est:+.2%} [{lo:+.2%}, {hi:+.2%}] vs max {c.threshold:+.2%}"
    if c.verdict == INCONCLUSIVE:
        more = f"; about {c.n_to_decide} documents would decide it" if c.n_to_decide else ""
        text += f" over {c.n} documents{more}"
    return Rule(task, c.verdict, f"{text}: {c.verdict}")


def speed_rule(policy: Gate, build: Measured, baseline: Measured, byte_ratio: float) -> tuple[Rule, float | None]:
    """Speed-up over the baseline in the policy's regime; a suspect decode speed-up cannot pass."""
    kernels = " (emulated kernels)" if build.kernels.startswith("emulated") else ""
    if build.regime == "server":
        where = (
            f"goodput {build.speed:.3g} vs {baseline.speed:.3g} requests/s within the SLO, "
            f"{build.users_at_slo} vs {baseline.users_at_slo} users at the SLO"
        )
    else:
        where = f"decode {build.speed:.4g} vs {baseline.speed:.4g} tok/s per user at batch {policy.speed_batch}"
    if baseline.speed <= 0:
        verdict = NOT_GATED if policy.min_speedup is None else INCONCLUSIVE
        return Rule("speed", verdict, f"speed: the baseline has no speed to compare with, {where}: {verdict}"), None
    up = build.speed / baseline.speed
    if build.engine != baseline.engine:
        # e.g. the baseline's decode compiled while this build's format could not be, or served by another
        # engine: not one harness
        where += f", {build.engine or '?'} vs the baseline's {baseline.engine or '?'}: not the same harness"
        verdict = NOT_GATED if policy.min_speedup is None else INCONCLUSIVE
        return Rule("speed", verdict, f"speed: {up:.2f}x, {where}{kernels}: {verdict}"), up
    if policy.min_speedup is None:
        return Rule("speed", NOT_GATED, f"speed: {up:.2f}x, {where}{kernels}: not gated (min_speedup: null)"), up
    # a decode speed-up beyond the weight-bytes ratio is suspect; server goodput can rise further (more KV room)
    if build.regime == "engine" and speed_math.speedup_is_suspect(up, byte_ratio):
        text = f"speed: {up:.2f}x exceeds the {byte_ratio:.2f}x the weight bytes allow, {where}: suspect"
        return Rule("speed", INCONCLUSIVE, f"{text}: {INCONCLUSIVE}"), up
    verdict = PASS if up >= policy.min_speedup else FAIL
    return Rule("speed", verdict, f"speed: {up:.2f}x vs min {policy.min_speedup:g}x, {where}{kernels}: {verdict}"), up


def memory_rule(policy: Gate, build: Measured) -> Rule:
    where = f"peak {build.peak_gb:.3g} GB at batch {policy.speed_batch}"
    if policy.memory_budget_gb is None:
        return Rule("memory", NOT_GATED, f"memory: {where}: not gated (no memory_budget_gb)")
    verdict = PASS if build.peak_gb <= policy.memory_budget_gb else FAIL
    return Rule("memory", verdict, f"memory: {where} vs budget {policy.memory_budget_gb:g} GB: {verdict}")


def fit_rule(projected: list[Fit]) -> Rule:
    """Every GPU the policy names must hold the build on one device (eval/sizing.py's projection)."""
    where = ", ".join(f"{f.gpu} {f.total_gb:.3g} of {f.usable_gb:.3g} GB" for f in projected)
    missing = [f.gpu for f in projected if not f.fits]
    verdict = FAIL if missing else PASS
    text = f"fit: {where}" + (f"; does not fit {', '.join(missing)}" if missing else "")
    return Rule("fit", verdict, f"{text}: {verdict}")


def choose(builds: list[BuildVerdict], prefer: str, tie: float) -> tuple[str | None, str]:
    """The build that ships among those that passed, and why.

    prefer "speed": the fastest; builds within `tie` of it count as equal and the smallest weights win.
    prefer "memory": the smallest weights; builds within `tie` of it count as equal and the fastest wins.
    """
    passed = [b for b in builds if b.verdict == PASS]
    if not passed:
        return None, "no quantized build passed every rule"
    if prefer == "speed":
        best = max(b.speed.speed for b in passed)
        ties = [b for b in passed if b.speed.speed >= best * (1 - tie)]
        pick = min(ties, key=lambda b: (b.speed.weights_gb, -b.speed.speed))
        how = "fastest"
    else:
        least = min(b.speed.weights_gb for b in passed)
        ties = [b for b in passed if b.speed.weights_gb <= least * (1 + tie)]
        pick = max(ties, key=lambda b: (b.speed.speed, -b.speed.weights_gb))
        how = "smallest weights"
    others = [b.precision for b in ties if b is not pick]
    breaker = "smaller weights" if prefer == "speed" else "faster one"
    tied = f"; {', '.join(others)} within {tie:.0%} of it, so the {breaker} decides" if others else ""
    passing = ", ".join(b.precision for b in passed)
    return pick.precision, f"{how} among the builds that passed ({passing}){tied}"


# ---- the gate ----------------------------------------------------------------------------------


def vs_ship_rule(shipped: str, task: str, c: Comparison) -> Rule:
    """A task against the build that ships now: the same statistics and threshold as against the baseline."""
    rule = task_rule(task, c)
    return Rule(f"{task} vs {shipped}", rule.verdict, f"vs {shipped}: {rule.reason}")


def judge(
    card: ModelCard,
    precision: str,
    baseline: Measured,
    baseline_bytes: float,
    shipped: tuple[str, Evaluation] | None = None,
) -> BuildVerdict:
    """Every rule of the card's policy applied to one quantized build; with `shipped` (the name and the
    evaluation of the build alias `ship` points at), its tasks against that build's too."""
    policy = card.gate
    tasks: dict[str, Comparison] = task_comparisons(card, precision)
    vs_ship = paired_with(card, precision, shipped[1]) if shipped else {}
    build, weight_bytes = measured(card, precision)
    rules = [task_rule(t, c) for t, c in tasks.items()]
    rules += [vs_ship_rule(shipped[0], t, c) for t, c in vs_ship.items()] if shipped else []
    fast, up = speed_rule(policy, build, baseline, baseline_bytes / weight_bytes)
    rules += [fast, memory_rule(policy, build)]
    if policy.must_fit:
        rules.append(fit_rule(fits(card, precision)))
    return BuildVerdict(
        precision=precision, verdict=combine([r.verdict for r in rules]), rules=rules, tasks=tasks, speed=build,
        speedup=up, vs_ship=vs_ship,
    )  # fmt: skip


def decide(
    card: ModelCard, shipped: tuple[str, Evaluation] | None = None, against: dict[str, str] | None = None
) -> Decision:
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


def _shipped(card: ModelCard, tracker: Tracker) -> tuple[tuple[str, Evaluation] | None, dict[str, str]]:
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


def gate(card: ModelCard, tracker: Tracker, *, against: str | None = None) -> Decision:
    """Decide, then record the decision: gate.json, MLflow tags, and the registry alias `ship`.

    `against="ship"`: a regression gate, every build also compared with the build that ships now."""
    fetch_builds(card, tracker)
    shipped, info = _shipped(card, tracker) if against == SHIP else (None, {})
    decision = decide(card, shipped, info)
    for b in decision.builds:
        log.info("%s@%s: %s", card.name, b.precision, b.verdict)
        for r in b.rules:
            log.debug("    %s", r.reason)
    tracker.log_verdicts(decision)
    if decision.chosen:
        run_id = tracker.build_run(decision.chosen)
        registered = tracker.register_ship(
            run_id, checkpoint_source(card, tracker, decision.chosen, run_id), decision.why
        )
        decision = decision.model_copy(update={"registered": registered})
        log.info("%s: ships %s (%s)", card.name, decision.chosen, decision.why)
    elif shipped:  # a regression gate that nothing passed: what is deployed stays deployed
        log.warning("%s: nothing replaces %s: %s", card.name, shipped[0], decision.why)
    else:
        tracker.clear_ship()
        log.warning("%s: nothing ships: %s", card.name, decision.why)
    tracker.log_decision(decision, write_decision(decision))
    return decision
