"""The gate's policy as pure functions: each rule's verdict on one build, a build's verdict from its rules,
and the choice among the builds that passed. Numbers in, verdicts and reasons out; nothing is read here.
"""

from __future__ import annotations

from eval.devices import speed as speed_math
from eval.devices.sizing import Fit
from eval.quality.stats import Comparison, LengthBand, Verdict
from pipelines.core.card.cards import Gate, ModelCard
from pipelines.core.store.verdicts import BuildVerdict, Measured, Rule
from quant.execution import Execution


def speed_label(card: ModelCard) -> str:
    """What the speed figures of the decision are, under the policy's regime."""
    if card.gate.speed_regime == "server":
        return f"goodput, requests/s within the SLO at {card.judged_users} users"
    return f"decode tokens/s per user at batch {card.gate.speed_batch}"


def combine(verdicts: list[Verdict]) -> Verdict:
    """A build's verdict from its rules': any FAIL fails, else any INCONCLUSIVE, else PASS."""
    if Verdict.FAIL in verdicts:
        return Verdict.FAIL
    if Verdict.INCONCLUSIVE in verdicts:
        return Verdict.INCONCLUSIVE
    return Verdict.PASS


def task_rule(task: str, c: Comparison) -> Rule:
    est, lo, hi = c.statistic
    if c.rule == "recovery":
        text = f"{task}: {c.metric} recovery {est:.4f} [{lo:.4f}, {hi:.4f}] vs min {c.threshold:g}"
    else:
        text = f"{task}: {c.metric} perplexity {est:+.2%} [{lo:+.2%}, {hi:+.2%}] vs max {c.threshold:+.2%}"
    if c.verdict == Verdict.INCONCLUSIVE:
        more = f"; about {c.n_to_decide} documents would decide it" if c.n_to_decide else ""
        text += f" over {c.n} documents{more}"
    return Rule(task, c.verdict, f"{text}: {c.verdict}")


def length_rule(policy: Gate, task: str, length: LengthBand) -> Rule:
    """A generative task's output length against the baseline's, within the policy's band."""
    est, lo, hi = length.ratio
    text = (
        f"{task}: output length {est:.3f}x the baseline's [{lo:.3f}, {hi:.3f}] "
        f"({length.build:.3g} vs {length.baseline:.3g} tokens per document)"
    )
    name = f"{task} length"
    if policy.max_length_change is None:
        return Rule(name, Verdict.NOT_GATED, f"{text}: not gated (max_length_change: null)")
    return Rule(name, length.verdict, f"{text} vs band ±{length.band:.0%}: {length.verdict}")


def speed_rule(policy: Gate, build: Measured, baseline: Measured, byte_ratio: float) -> tuple[Rule, float | None]:
    """Speed-up over the baseline in the policy's regime; a suspect decode speed-up cannot pass."""
    kernels = " (emulated kernels)" if build.execution == Execution.EMULATED else ""
    if build.regime == "server":
        where = (
            f"goodput {build.speed:.3g} vs {baseline.speed:.3g} requests/s within the SLO, "
            f"{build.users_at_slo} vs {baseline.users_at_slo} users at the SLO"
        )
    else:
        where = f"decode {build.speed:.4g} vs {baseline.speed:.4g} tok/s per user at batch {policy.speed_batch}"
    if baseline.speed <= 0:
        verdict = Verdict.NOT_GATED if policy.min_speedup is None else Verdict.INCONCLUSIVE
        return Rule("speed", verdict, f"speed: the baseline has no speed to compare with, {where}: {verdict}"), None
    up = build.speed / baseline.speed
    if build.engine != baseline.engine:
        # e.g. the baseline's decode compiled while this build's format could not be, or served by another
        # engine: not one harness
        where += f", {build.engine or '?'} vs the baseline's {baseline.engine or '?'}: not the same harness"
        verdict = Verdict.NOT_GATED if policy.min_speedup is None else Verdict.INCONCLUSIVE
        return Rule("speed", verdict, f"speed: {up:.2f}x, {where}{kernels}: {verdict}"), up
    if policy.min_speedup is None:
        text = f"speed: {up:.2f}x, {where}{kernels}: not gated (min_speedup: null)"
        return Rule("speed", Verdict.NOT_GATED, text), up
    # a decode speed-up beyond the weight-bytes ratio is suspect; server goodput can rise further (more KV room)
    if build.regime == "engine" and speed_math.speedup_is_suspect(up, byte_ratio):
        text = f"speed: {up:.2f}x exceeds the {byte_ratio:.2f}x the weight bytes allow, {where}: suspect"
        return Rule("speed", Verdict.INCONCLUSIVE, f"{text}: {Verdict.INCONCLUSIVE}"), up
    verdict = Verdict.PASS if up >= policy.min_speedup else Verdict.FAIL
    return Rule("speed", verdict, f"speed: {up:.2f}x vs min {policy.min_speedup:g}x, {where}{kernels}: {verdict}"), up


def memory_rule(policy: Gate, build: Measured) -> Rule:
    where = f"peak {build.peak_gb:.3g} GB at batch {policy.speed_batch}"
    if policy.memory_budget_gb is None:
        return Rule("memory", Verdict.NOT_GATED, f"memory: {where}: not gated (no memory_budget_gb)")
    verdict = Verdict.PASS if build.peak_gb <= policy.memory_budget_gb else Verdict.FAIL
    return Rule("memory", verdict, f"memory: {where} vs budget {policy.memory_budget_gb:g} GB: {verdict}")


def cost_rule(policy: Gate, build: Measured) -> Rule:
    """The build's $ per million output tokens for the card's traffic against `max_cost_per_mtok`: PASS where
    its conservative end is within it, INCONCLUSIVE where only its optimistic end is, else FAIL."""
    cost = build.cost
    where = f"cost: {cost.text()}" if cost else "cost: not measured or sized on the device judged"
    if policy.max_cost_per_mtok is None:
        return Rule("cost", Verdict.NOT_GATED, f"{where}: not gated (no max_cost_per_mtok)")
    if cost is None or cost.usd_per_mtok is None:
        verdict = Verdict.FAIL if cost is not None and cost.why else Verdict.INCONCLUSIVE
        return Rule("cost", verdict, f"{where} vs max ${policy.max_cost_per_mtok:g}: {verdict}")
    if cost.judged is None and cost.user_tps is not None:
        # not priced at the card's per-user speed: too slow for it (FAIL), or not swept on this device
        verdict = Verdict.FAIL if cost.too_slow else Verdict.INCONCLUSIVE
        return Rule("cost", verdict, f"{where} vs max ${policy.max_cost_per_mtok:g} per 1M: {verdict}")
    cheap = cost.optimistic
    if cost.judged is not None and cost.judged <= policy.max_cost_per_mtok:
        verdict = Verdict.PASS  # the conservative end within it
    elif cheap is not None and cheap <= policy.max_cost_per_mtok:
        verdict = Verdict.INCONCLUSIVE  # the range straddles it: narrower users would decide
    else:
        verdict = Verdict.FAIL
    return Rule("cost", verdict, f"{where} vs max ${policy.max_cost_per_mtok:g} per 1M: {verdict}")


def fit_rule(projected: list[Fit]) -> Rule:
    """Every GPU the policy names must hold the build on one device (eval/devices/sizing.py's projection)."""
    where = ", ".join(f"{f.gpu} {f.total_gb:.3g} of {f.usable_gb:.3g} GB" for f in projected)
    missing = [f.gpu for f in projected if not f.fits]
    verdict = Verdict.FAIL if missing else Verdict.PASS
    text = f"fit: {where}" + (f"; does not fit {', '.join(missing)}" if missing else "")
    return Rule("fit", verdict, f"{text}: {verdict}")


def choose(builds: list[BuildVerdict], prefer: str, tie: float) -> tuple[str | None, str]:
    """The build that ships among those that passed, and why.

    prefer "speed": the fastest; builds within `tie` of it count as equal and the smallest weights win.
    prefer "memory": the smallest weights; builds within `tie` of it count as equal and the fastest wins.
    prefer "cost": the cheapest per million output tokens for the card's traffic, on the conservative end of a
    measured range (CostFigure.judged), at the card's per-user speed where it states one (`traffic.user_tps`);
    builds within `tie` of it count as equal and the smallest weights win; a build without a cost there cannot be
    chosen.
    """
    passed = [b for b in builds if b.verdict == Verdict.PASS]
    if not passed:
        return None, "no quantized build passed every rule"
    if prefer == "cost":
        return _cheapest(passed, tie)
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


def _cheapest(passed: list[BuildVerdict], tie: float) -> tuple[str | None, str]:
    priced = [b for b in passed if b.speed.cost and b.speed.cost.judged is not None]
    passing = ", ".join(b.precision for b in passed)
    if not priced:
        return None, f"no build that passed ({passing}) has a cost for the card's traffic on the device judged"
    least = min(b.speed.cost.judged for b in priced)
    ties = [b for b in priced if b.speed.cost.judged <= least * (1 + tie)]
    pick = min(ties, key=lambda b: (b.speed.weights_gb, b.speed.cost.judged))
    others = [b.precision for b in ties if b is not pick]
    tied = f"; {', '.join(others)} within {tie:.0%} of it, so the smaller weights decide" if others else ""
    return pick.precision, f"cheapest among the builds that passed ({passing}): {pick.speed.cost.text()}{tied}"


def vs_ship_rule(shipped: str, task: str, c: Comparison) -> Rule:
    """A task against the build that ships now: the same statistics and threshold as against the baseline."""
    rule = task_rule(task, c)
    return Rule(f"{task} vs {shipped}", rule.verdict, f"vs {shipped}: {rule.reason}")
