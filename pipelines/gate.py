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

import json
import logging
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from eval import speed as speed_math
from eval.stats import Comparison, compare, is_likelihood
from pipelines.cards import Gate, ModelCard
from pipelines.errors import QevalError
from pipelines.paths import artifacts_dir
from pipelines.quantize import checkpoint_for
from pipelines.stages import read_manifest, stage_dir, write_json_atomic
from pipelines.tracking import Tracker

log = logging.getLogger(__name__)

PASS, FAIL, INCONCLUSIVE, NOT_GATED, BASELINE = "PASS", "FAIL", "INCONCLUSIVE", "NOT GATED", "BASELINE"
METRIC_PREFERENCE = ("bits_per_byte", "acc_norm", "acc", "exact_match")
GATE_FILE = "gate.json"


@dataclass(frozen=True)
class Rule:
    """One rule of the policy applied to one build."""

    name: str  # a task name, "speed" or "memory"
    verdict: str  # PASS, FAIL, INCONCLUSIVE or NOT GATED
    reason: str


@dataclass(frozen=True)
class Measured:
    """What the gate needs of one build's speed and memory measurements."""

    decode_tps: float  # engine: tokens/s per user at the policy's batch
    peak_gb: float  # engine: peak memory at the policy's batch
    weights_gb: float
    kernels: str
    regime: str = "engine"
    goodput: float | None = None  # server: requests/s that met the SLO at the policy's users
    users_at_slo: int | None = None  # server: the most concurrent users that met the SLO

    @property
    def speed(self) -> float:
        """The figure the speed rule and the choice use, by the policy's regime."""
        return (self.goodput or 0.0) if self.regime == "server" else self.decode_tps


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


def task_threshold(policy: Gate, task: str, likelihood: bool) -> tuple[str, float]:
    """(rule, threshold) for a task: a perplexity bound where the policy sets one and the metric allows it."""
    if likelihood and policy.max_ppl_increase is not None and task not in policy.task_min_recovery:
        return "ppl_increase", policy.max_ppl_increase
    return "recovery", policy.task_min_recovery.get(task, policy.min_recovery)


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


# ---- reading the stages' results ---------------------------------------------------------------


def _done(card: ModelCard, precision: str, stage: str) -> dict:
    done = read_manifest(stage_dir(card.name, precision, stage))
    if not done or done.get("status") != "done":
        raise QevalError(
            f"gate: {card.name}@{precision} has no finished {stage} stage; run: qeval "
            f"{'serve-bench' if stage == 'serve' else stage} --model {card.name}"
            + (f" --precision {precision}" if precision != card.gate.baseline or stage == "bench" else "")
        )
    return done


def _at(series: list, batch: int, name: str, where: str) -> float:
    values = {int(b): float(v) for b, v in series}
    if batch not in values:
        raise QevalError(f"gate: {where} has no {name} at batch {batch} (out of memory there, or another grid)")
    return values[batch]


def measured(card: ModelCard, precision: str) -> tuple[Measured, float]:
    """The build's speed and memory at the policy's batch, and its weight bytes."""
    done = _done(card, precision, "bench")
    where = f"{card.name}@{precision} bench"
    if done["inputs"]["config"].get("no_weights"):
        raise QevalError(f"gate: {where} used random weights (--no-weights); bench the checkpoint: qeval bench")
    b = card.gate.speed_batch
    m = Measured(
        decode_tps=_at(done["series"].get("engine/decode_tps", []), b, "decode speed", where),
        peak_gb=_at(done["series"].get("mem/peak_gb", []), b, "peak memory", where),
        weights_gb=float(done["metrics"]["mem/weights_gb"]),
        kernels=done["params"].get("engine.kernels", "unknown"),
        regime=card.gate.speed_regime,
        **_server(card, precision),
    )
    return m, float(done["summary"]["weight_bytes"])


def judged_users(card: ModelCard) -> int:
    return card.gate.speed_users or max(card.speed.concurrency)


def _server(card: ModelCard, precision: str) -> dict[str, Any]:
    """Goodput at the judged concurrency and users at the SLO, from the serve stage (required by the
    server regime, shown where it exists otherwise)."""
    if card.gate.speed_regime == "server":
        done = _done(card, precision, "serve")
    else:
        done = read_manifest(stage_dir(card.name, precision, "serve"))
        if not done or done.get("status") != "done":
            return {}
    users = judged_users(card)
    level = done["summary"]["per_level"].get(str(users))
    if level is None:
        raise QevalError(f"gate: {card.name}@{precision} serve has no level at {users} users; rerun qeval serve-bench")
    return {"goodput": float(level.get("goodput", 0.0)), "users_at_slo": int(done["summary"]["max_users_at_slo"])}


def gating_metric(card: ModelCard, task: str, results: dict[str, Any], row: dict[str, Any]) -> tuple[str, str]:
    """(metric, filter) that gates `task`: the card's choice, else the first of METRIC_PREFERENCE present.

    The filter is `none` where lm-eval reports one, else the first it reports (gsm8k: strict-match).
    """
    reported: dict[str, list[str]] = {}
    for key in results:
        metric, _, filt = key.partition(",")
        if filt and not metric.endswith("_stderr") and metric in row:
            reported.setdefault(metric, []).append(filt)
    chosen = card.gate.task_metric.get(task)
    if chosen:
        metric, _, filt = chosen.partition(",")
        if metric not in reported:
            raise QevalError(
                f"gate.task_metric: task '{task}' has no per-document '{metric}'; it has: {sorted(reported)}"
            )
        return metric, filt or ("none" if "none" in reported[metric] else reported[metric][0])
    if not reported:
        raise QevalError(f"gate: task '{task}' has no per-document metric to compare")
    metric = next((m for m in METRIC_PREFERENCE if m in reported), next(iter(reported)))
    return metric, "none" if "none" in reported[metric] else reported[metric][0]


def leaves(task: str, groups: dict[str, list[str]]) -> list[str]:
    """The tasks with per-document records under `task`: itself, or a group's subtasks, recursively."""
    if task not in groups:
        return [task]
    return [leaf for sub in groups[task] for leaf in leaves(sub, groups)]


def per_document(folder: Path, tasks: list[str], metric: str, filt: str) -> dict[tuple[str, Any], Any]:
    """(task, doc_id) -> the metric's per-document value, from lm-eval's logged samples.

    A group's documents are pooled, which weighs each subtask by its size as lm-eval's groups do.
    """
    out = {}
    for task in tasks:
        path = folder / f"samples_{task}.jsonl"
        if not path.is_file():
            raise QevalError(f"gate: no per-document records {path}; rerun: qeval evaluate --force")
        with path.open() as f:
            for line in f:
                row = json.loads(line)
                if row.get("filter", filt) == filt and metric in row:
                    out[(task, row["doc_id"])] = row[metric]
    return out


def _first_row(folder: Path, task: str) -> dict[str, Any]:
    with (folder / f"samples_{task}.jsonl").open() as f:
        return json.loads(f.readline())


def _groups(folder: Path) -> dict[str, list[str]]:
    try:
        return json.loads((folder / "lm_eval_results.json").read_text()).get("group_subtasks") or {}
    except (OSError, ValueError):
        return {}


def task_comparisons(card: ModelCard, precision: str, base_eval: dict, build_eval: dict) -> dict[str, Comparison]:
    """The paired comparison of every task of the card between the build and the baseline."""
    base_dir = stage_dir(card.name, card.gate.baseline, "evaluate")
    build_dir = stage_dir(card.name, precision, "evaluate")
    if build_eval["inputs"]["config"] != base_eval["inputs"]["config"]:
        raise QevalError(
            f"gate: {card.name}@{precision} was evaluated with other settings than the baseline; rerun both "
            f"with the card's settings: qeval run --model {card.name}"
        )
    groups = _groups(base_dir)
    out = {}
    for task in card.accuracy.tasks:
        subtasks = leaves(task, groups)
        results = base_eval["summary"]["results"].get(task) or base_eval["summary"]["results"][subtasks[0]]
        metric, filt = gating_metric(card, task, results, _first_row(base_dir, subtasks[0]))
        base = per_document(base_dir, subtasks, metric, filt)
        build = per_document(build_dir, subtasks, metric, filt)
        if base.keys() != build.keys() or not base:
            raise QevalError(f"gate: {card.name}@{precision} {task}: not the baseline's documents; rerun evaluate")
        docs = sorted(base, key=str)
        base_v, build_v = [base[d] for d in docs], [build[d] for d in docs]
        hib_all = base_eval["summary"]["higher_is_better"]
        hib = (hib_all.get(task) or hib_all.get(subtasks[0]) or {}).get(metric, True)
        rule, threshold = task_threshold(card.gate, task, is_likelihood(base_v))
        out[task] = compare(
            metric, base_v, build_v, higher_is_better=hib, rule=rule, threshold=threshold,
            confidence=card.gate.confidence,
        )  # fmt: skip
    return out


# ---- the gate ----------------------------------------------------------------------------------


def decide(card: ModelCard) -> Decision:
    """Apply the card's policy to the finished evaluate and bench stages of every build."""
    policy = card.gate
    base_eval = _done(card, policy.baseline, "evaluate")
    base_speed, base_bytes = measured(card, policy.baseline)
    verdicts = []
    for precision in card.precisions:
        if precision == policy.baseline:
            continue
        tasks = task_comparisons(card, precision, base_eval, _done(card, precision, "evaluate"))
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
