"""The gate: which quantized build ships, under the policy in the model card (`gate:`).

Per build and task, a paired comparison with the baseline on the same documents (eval/stats.py)
gives an interval on recovery (or on the perplexity increase) and a verdict: PASS, FAIL or
INCONCLUSIVE. The speed rule compares decode tokens/s per user at the policy's batch size with the
baseline's; the memory rule compares peak memory there with the budget. A build passes only when
every rule passes; among passing builds the policy's preference picks the one that ships.

The result goes to artifacts/<model>/gate.json, to tags `qeval.gate.verdict` and `qeval.gate.reasons`
on every build's MLflow run, and to the Model Registry: `qeval-<model>`, alias `ship`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from eval import speed as speed_math
from eval.stats import Comparison
from pipelines.cards import Gate, ModelCard
from pipelines.gate_inputs import Measured, finished, measured, task_comparisons
from pipelines.paths import artifacts_dir
from pipelines.quantize import checkpoint_for
from pipelines.stages import write_json_atomic
from pipelines.tracking import Tracker

log = logging.getLogger(__name__)

PASS, FAIL, INCONCLUSIVE, NOT_GATED, BASELINE = "PASS", "FAIL", "INCONCLUSIVE", "NOT GATED", "BASELINE"
GATE_FILE = "gate.json"


@dataclass(frozen=True)
class Rule:
    """One rule of the policy applied to one build."""

    name: str  # a task name, "speed" or "memory"
    verdict: str  # PASS, FAIL, INCONCLUSIVE or NOT GATED
    reason: str


def speed_label(policy: Gate, users: int | None = None) -> str:
    if policy.speed_regime == "server":
        return f"goodput, requests/s within the SLO at {users} users"
    return f"decode tokens/s per user at batch {policy.speed_batch}"


@dataclass(frozen=True)
class BuildVerdict:
    precision: str
    verdict: str
    rules: list[Rule]
    tasks: dict[str, Comparison]
    speed: Measured
    speedup: float | None

    @property
    def reasons(self) -> list[str]:
        return [r.reason for r in self.rules]


@dataclass
class Decision:
    model: str
    policy: dict[str, Any]
    baseline: Measured
    builds: list[BuildVerdict]
    chosen: str | None
    why: str
    registered: dict[str, str] = field(default_factory=dict)
    decided: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "decided": self.decided,
            "policy": self.policy,
            "baseline": asdict(self.baseline),
            "chosen": self.chosen,
            "why": self.why,
            "registered": self.registered,
            "builds": [
                {
                    "precision": b.precision,
                    "verdict": b.verdict,
                    "reasons": b.reasons,
                    "speed": asdict(b.speed),
                    "speedup": b.speedup,
                    "tasks": {t: asdict(c) for t, c in b.tasks.items()},
                }
                for b in self.builds
            ],
        }


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
    if build.regime == "engine" and build.engine != baseline.engine:
        # e.g. the baseline's decode compiled while this build's format could not be: not one harness
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


def fit_rule(fits: list) -> Rule:
    """Every GPU the policy names must hold the build on one device (eval/sizing.py's projection)."""
    where = ", ".join(f"{f.gpu} {f.total_gb:.3g} of {f.usable_gb:.3g} GB" for f in fits)
    missing = [f.gpu for f in fits if not f.fits]
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


def decide(card: ModelCard) -> Decision:
    """Apply the card's policy to the finished evaluate and bench stages of every build."""
    policy = card.gate
    base_eval = finished(card, policy.baseline, "evaluate")
    base_speed, base_bytes = measured(card, policy.baseline)
    verdicts = []
    for precision in card.precisions:
        if precision == policy.baseline:
            continue
        tasks = task_comparisons(card, precision, base_eval, finished(card, precision, "evaluate"))
        speed, weight_bytes = measured(card, precision)
        rules = [task_rule(t, c) for t, c in tasks.items()]
        fast, up = speed_rule(policy, speed, base_speed, base_bytes / weight_bytes)
        rules += [fast, memory_rule(policy, speed)]
        if policy.must_fit:
            from pipelines.size import fits_table

            s = card.speed
            grid = {"batch": max(s.batch_sizes), "input_len": s.input_lengths[0], "output_len": s.output_lengths[0]}
            rules.append(fit_rule(fits_table(card, [precision], policy.must_fit, **grid)))
        verdict = combine([r.verdict for r in rules])
        verdicts.append(BuildVerdict(precision, verdict, rules, tasks, speed, up))
    chosen, why = choose(verdicts, policy.prefer, policy.tie_tolerance)
    return Decision(card.name, policy.model_dump(), base_speed, verdicts, chosen, why)


def _headline(m: Measured) -> dict[str, float | None]:
    return {"gate/decode_tps": m.decode_tps, "gate/goodput": m.goodput, "gate/users_at_slo": m.users_at_slo}


def gate(card: ModelCard, tracker: Tracker) -> Decision:
    """Decide, then record the decision: gate.json, MLflow tags, and the registry alias `ship`."""
    decision = decide(card)
    for b in decision.builds:
        log.info("%s@%s: %s", card.name, b.precision, b.verdict)
        for r in b.rules:
            log.debug("    %s", r.reason)
    base = decision.baseline
    tracker.tag_build(
        tracker.build_run(card.gate.baseline),
        BASELINE,
        ["the baseline every build is compared with"],
        {"gate/recovery_worst": 1.0, "gate/speedup": 1.0, **_headline(base)},
    )
    for b in decision.builds:
        worst = min(b.tasks.values(), key=lambda c: c.recovery[0])
        tracker.tag_build(
            tracker.build_run(b.precision),
            b.verdict,
            b.reasons,
            {
                "gate/recovery_worst": worst.recovery[0],
                "gate/recovery_worst_lower": worst.recovery[1],
                "gate/speedup": b.speedup,
                **_headline(b.speed),
            },
        )
    if decision.chosen:
        checkpoint, _ = checkpoint_for(card, decision.chosen)
        decision.registered = tracker.register_ship(
            tracker.build_run(decision.chosen), str(Path(checkpoint).resolve()), decision.why
        )
        log.info("%s: ships %s (%s)", card.name, decision.chosen, decision.why)
    else:
        tracker.clear_ship()
        log.warning("%s: nothing ships: %s", card.name, decision.why)
    path = artifacts_dir() / card.name / GATE_FILE
    write_json_atomic(path, decision.as_json())
    tracker.log_summary(decision.policy, path, "gate", chosen=decision.chosen or "none")
    return decision
