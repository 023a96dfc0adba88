"""The report's tables, as Markdown lines and as columns: the decision at a glance, every figure per build,
what held each build's users, the projected fits, accuracy as served. Read from the gate's decision and the
builds' finished stages.
"""

from __future__ import annotations

from collections import Counter

import eval.load.serving as serving
from eval.devices.sizing import Fit
from eval.quality.sequential import betting_floor
from eval.quality.stats import Verdict
from pipelines.core.card.cards import ModelCard
from pipelines.core.store import formats
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Served, Sized
from pipelines.core.store.verdicts import Decision


def table(card: ModelCard, decision: Decision) -> dict[str, list]:
    """The gate table, one row per build, as columns (for MLflow's log_table and the Markdown file)."""
    cols: dict[str, list] = {"build": [], "verdict": []}
    for task in card.accuracy.tasks:
        cols[f"{task} recovery [interval]"] = []
    users = card.judged_users
    cols |= {
        f"decode tok/s per user, batch {decision.policy.speed_batch}": [],
        f"server goodput req/s, {users} users": [],
        "users at SLO": [],
        f"speed-up in {decision.speed_axis}": [],  # not the output tokens/s the capacity table's crossover reads
        "weights": [],
        "peak": [],
        "kernels": [],
    }
    base = decision.baseline
    rows = [(decision.policy.baseline, Verdict.BASELINE, None, base, 1.0)] + [
        (b.precision, b.verdict + (" (ships)" if b.precision == decision.chosen else ""), b, b.speed, b.speedup)
        for b in decision.builds
    ]
    for precision, verdict, b, speed, up in rows:
        cols["build"].append(precision)
        cols["verdict"].append(verdict)
        for task in card.accuracy.tasks:
            c = b.tasks.get(task) if b else None
            shown = f"{c.recovery[0]:.4f} [{c.recovery[1]:.4f}, {c.recovery[2]:.4f}] {c.verdict}" if c else "1"
            cols[f"{task} recovery [interval]"].append("not scored" if b and task in b.not_scored else shown)
        cols[f"decode tok/s per user, batch {decision.policy.speed_batch}"].append(f"{speed.decode_tps:.4g}")
        cols[f"server goodput req/s, {users} users"].append("" if speed.goodput is None else f"{speed.goodput:.3g}")
        at_least = "at least " if speed.users_bound else ""
        cols["users at SLO"].append("" if speed.users_at_slo is None else f"{at_least}{speed.users_at_slo}")
        cols[f"speed-up in {decision.speed_axis}"].append(f"{up:.2f}x" if up is not None else "")
        cols["weights"].append(formats.size(speed.weights_gb))
        cols["peak"].append(formats.size(speed.peak_gb))
        cols["kernels"].append(f"{speed.execution} ({speed.engine})" if speed.engine else str(speed.execution))
    return cols


def short_table(decision: Decision) -> list[str]:
    """The decision at a glance: one row per build, the figures the gate used."""
    speed = "goodput req/s" if decision.policy.speed_regime == "server" else "decode tok/s per user"
    lines = [
        f"| build | verdict | worst recovery [{decision.policy.confidence:.0%} interval] | weights | {speed} "
        "| users within the SLO [on intervals] | kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [(decision.policy.baseline, "baseline", None, decision.baseline)]
    rows += [
        (b.precision, b.verdict + (", **ships**" if b.precision == decision.chosen else ""), b, b.speed)
        for b in decision.builds
    ]
    for precision, verdict, b, m in rows:
        worst = "1 (reference)"
        if b is not None:
            task, c = b.worst_task()
            worst = f"{c.recovery[0]:.4f} [{c.recovery[1]:.4f}, {c.recovery[2]:.4f}] {task}"
        figure = f"{m.goodput or 0:.3g}" if m.regime == "server" else f"{m.decode_tps:.4g}"
        users = "" if m.users_at_slo is None else str(m.users_at_slo)
        if m.users_bound and users:
            users = f"at least {users}"
        elif m.users_range is not None and users:
            users += f" [{m.users_range[0]}, {m.users_range[1]}]"
        lines.append(
            f"| {precision} | {verdict} | {worst} | {formats.size(m.weights_gb)} | {figure} | {users} | {m.execution} |"
        )
    return lines


def slo_limits(card: ModelCard) -> list[str]:
    """Per build, how many users the server held within the SLO and what broke it at the next level."""
    slo, lines = card.speed.main_slo, []
    for p in card.precisions:
        served = result_of(card.name, p, Served)
        if served is None:
            continue
        if not served.per_level:
            lines.append(f"- {p}: NOT SERVED: {served.not_run}")
            continue
        missed = next(((c, m) for c, m in sorted(served.per_level.items()) if not m.meets_slo), None)
        if missed is None:
            held = formats.users_count(served.max_users_at_slo, served.users_bound)
            lines.append(f"- {p}: {held}, no level missed ({served.execution}){_range(served)}")
            continue
        c, m = missed
        why = []
        if m.ttft_ms_p95 is not None and m.ttft_ms_p95 > slo.ttft_ms:
            why.append(f"TTFT p95 {m.ttft_ms_p95:.0f} ms > {slo.ttft_ms:g} ms")
        if m.tpot_ms_p95 is not None and m.tpot_ms_p95 > slo.tpot_ms:
            why.append(f"TPOT p95 {m.tpot_ms_p95:.1f} ms > {slo.tpot_ms:g} ms")
        if m.failed:
            why.append(f"{m.failed} failed requests")
        if m.bursts:
            why.append(f"{m.bursts} unstreamed (burst) requests")
        if m.server is not None:  # the server's own view of that level (its /metrics)
            why.append(f"by the server's metrics, {serving.what_broke(m)}")
        held, at = formats.users_count(served.max_users_at_slo), formats.users_count(c)
        lines.append(f"- {p}: {held}; at {at} {', '.join(why) or 'missed'} ({served.execution}){_range(served)}")
    return lines


def _range(served: Served) -> str:
    """Users within the objective as the levels' p95 intervals bound them, and each level's verdict on them."""
    if served.users_at_slo_interval is None:
        return ""
    levels = ", ".join(f"{c} {m.slo_verdict}" for c, m in sorted(served.per_level.items()))
    return f"; {users_range(served)} ({levels})"


def users_range(served: Served) -> str:
    """ "on the p95s' 95 % intervals over requests, 4 to 9 users", with the levels the edge search added and
    why the levels have the requests they have; "" where the levels were not judged on intervals."""
    if served.users_at_slo_interval is None:
        return ""
    lo, hi = served.users_at_slo_interval
    text = f"on the p95s' 95 % intervals over requests, {lo} to {hi} users"
    if served.users_bound:
        text = f"on the p95s' 95 % intervals over requests, at least {lo} users (none missed up to {hi}: the sweep "
        text += f"stopped at {served.users_bound})"
    if added := sorted(set(served.per_level) - set(served.load.concurrency)):
        text += f"; levels {', '.join(map(str, added))} added toward the objective's edge"
    if sizing := Counter(m.sizing for m in served.per_level.values() if m.sizing):
        each = (f"{why} ({n} level{'s' if n > 1 else ''})" for why, n in sizing.most_common())
        text += f"; requests per level: {'; '.join(each)}"
    return text


def policy_text(decision: Decision) -> str:
    g = decision.policy
    guarantee = formats.guarantee(decision)[:-1]  # a sentence of its own elsewhere, a clause here
    parts = [
        f"baseline {g.baseline}",
        f"every task's recovery at least {g.min_recovery:g} over its whole interval",
        guarantee[0].lower() + guarantee[1:],
    ]
    if g.task_min_recovery:
        parts.append("per task: " + ", ".join(f"{t} {v:g}" for t, v in g.task_min_recovery.items()))
    if g.max_ppl_increase is not None:
        parts.append(f"perplexity tasks: perplexity up by at most {g.max_ppl_increase:.2%}")
    if g.max_length_change is not None:
        parts.append(f"generative tasks: output length within ±{g.max_length_change:.0%} of the baseline's")
    speed = f"at least {g.min_speedup:g}x" if g.min_speedup is not None else "not gated"
    parts.append(f"speed-up in {decision.speed_axis}: {speed}")
    parts.append(f"memory budget: {f'{g.memory_budget_gb:g} GB' if g.memory_budget_gb else 'none'}")
    if g.max_cost_per_mtok is not None:
        parts.append(f"cost: at most ${g.max_cost_per_mtok:g} per million output tokens")
    parts.append(f"prefer {g.prefer} (ties within {g.tie_tolerance:.0%})")
    drawn = "the intervals shown beside the sequences" if g.verdicts == "sequential" else "the verdicts"
    parts.append(f"paired bootstrap ({drawn}): {g.bootstrap_resamples} resamples, seed {g.bootstrap_seed}")
    if g.stop_scoring != "never":
        parts.append(STOP_TEXT[g.stop_scoring])
    return "; ".join(parts)


STOP_TEXT = {
    "fail": "every build scored one task at a time, a quantized build's scoring stopped at its first task that "
    "failed (gate.stop_scoring: fail)",
    "inconclusive": "every build scored one task at a time, a quantized build's scoring stopped at its first task "
    "that failed or was INCONCLUSIVE (gate.stop_scoring: inconclusive)",
}


def fit_cells(f: Fit) -> dict[str, str]:
    """One projected fit as the cells people read (the CLI's size table and the report's)."""
    return {
        "gpu": f.gpu,
        "precision": f.precision,
        "runs": f"{f.execution} ({f.why_not})" if f.why_not else f.execution,
        "fits": "yes" if f.fits else (f"TP {f.tensor_parallel}" if f.tensor_parallel else "no"),
        "total": formats.size(f.total_gb),
        "weights": formats.size(f.weights_gb),
        "KV cache": formats.size(f.kv_gb),
        "max seqs": formats.count(f.max_sequences),
        "decode tok/s/user": formats.count(f.decode_tps_per_user, cap=100_000),
        "TTFT ms": formats.ms(f.ttft_ms),
    }


def served_section(card: ModelCard) -> list[str]:
    """Each build's accuracy through its server against its offline accuracy, where the card asks for it;
    a difference whose paired interval excludes 0 is called out."""
    rows, found = [], []
    for p in card.precisions:
        served = result_of(card.name, p, Served)
        if served is None or served.accuracy is None:
            continue
        for task, c in served.accuracy.vs_offline.items():
            est, lo, hi = c.difference
            same = ("**differs**" if c.differs else "same") + (
                "" if c.identical is None else f"; {c.identical} of {c.n} outputs identical"
            )
            rows.append(
                f"| {p} | {task} | {c.metric} | {c.n} | {c.offline:.5g} | {c.served:.5g} | "
                f"{est:+.2g} [{lo:+.2g}, {hi:+.2g}] | {same} |"
            )
            if c.differs:
                found.append(f"{p} {task}")
    if not rows:
        return []
    verdict = (
        f"**Finding:** served accuracy differs from offline for {', '.join(found)}."
        if found
        else ("Every build scores the same through its server as offline, within the paired interval.")
    )
    return [
        "",
        "## Accuracy as served (vLLM) against offline (transformers), same documents",
        "",
        verdict,
        "",
        "| build | task | metric | documents | offline | served | served - offline [interval] | |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def generation_section(decision: Decision) -> list[str]:
    """Per generative task and build: the gating score's recovery, the output length against the baseline's,
    and where greedy outputs first depart from the baseline's (quartiles of the documents that depart)."""
    rows = []
    for b in decision.builds:
        for task, g in b.generation.items():
            c, (est, lo, hi) = b.tasks.get(task), g.length.ratio
            score = f"{c.metric} {c.recovery[0]:.4f} [{c.recovery[1]:.4f}, {c.recovery[2]:.4f}]" if c else ""
            q = g.departures.quartiles
            quartiles = "/".join(f"{v:g}" for v in q) if q else "-"
            rows.append(
                f"| {b.precision} | {task} | {score} | {est:.3f} [{lo:.3f}, {hi:.3f}] {g.length.verdict} | "
                f"{g.length.build:.3g} vs {g.length.baseline:.3g} | {quartiles} | "
                f"{g.departures.identical} of {len(g.departures.positions)} |"
            )
    if not rows:
        return []
    return [
        "",
        "## Generated text against the baseline's, same documents (greedy)",
        "",
        "Length: total generated tokens over the baseline's, paired interval (the length rule holds it within the "
        "policy's band). Departure: the first generated token that differs from the baseline's output, as "
        "quartiles over the documents that depart; an early departure on many documents shows before a score moves.",
        "",
        "| build | task | recovery [interval] | length ratio [interval] | tokens per document | "
        "departure at token (25/50/75 %) | identical outputs |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def flips_section(decision: Decision) -> list[str]:
    """Per multiple-choice task and build: its recovery beside how many answers differ from the baseline's (with
    a Wilson interval), and of those, how many went from right to wrong and from wrong to right."""
    rows = []
    for b in decision.builds:
        for task, f in b.flips.items():
            c, (est, lo, hi) = b.tasks.get(task), f.rate
            score = f"{c.metric} {c.recovery[0]:.4f} [{c.recovery[1]:.4f}, {c.recovery[2]:.4f}]" if c else ""
            lost, won = c.discordant if c and c.discordant else ("-", "-")
            rows.append(
                f"| {b.precision} | {task} | {score} | {f.flipped:,} of {f.n:,} | "
                f"{est:.2%} [{lo:.2%}, {hi:.2%}] | {lost} | {won} |"
            )
    if not rows:
        return []
    return [
        "",
        "## Answers that changed, same documents",
        "",
        "A build can keep its accuracy and still answer differently: the share of multiple-choice documents whose "
        "chosen answer differs from the baseline's (as the judging metric picks it), with a "
        f"{decision.policy.confidence:.0%} Wilson interval; "
        "right to wrong and wrong to right are the documents whose score changed. Shown, not gated.",
        "",
        "| build | task | recovery [interval] | answers changed | share [interval] | right to wrong | wrong to right |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


NEAR_MISS = 4  # an undecided task that this many times its documents would likely decide is a near miss


def _reading(c) -> str:
    need = c.n_to_decide
    if need is None:
        return "the estimate sits on the threshold: no number of documents decides it"
    if c.verdict != Verdict.INCONCLUSIVE:
        return f"decided; {need / c.n:.0%} of them would have done" if need < c.n else "decided, with all of them"
    kind = "near miss" if need <= NEAR_MISS * c.n else "out of reach"
    return f"{kind}: {need / c.n:.1f}x the documents"


def _resolution(c) -> str:
    return f"±{c.resolution:.4f}" if c.resolution is not None else ""


def _fewest(c) -> str:
    """The fewest documents in which the task can PASS a build that scores every one as the baseline does."""
    if c.method != "betting":
        return "the first look" if c.method == "mixture" else ""
    fewest = betting_floor((1 - c.threshold) * c.baseline, -c.threshold, 1.0, c.alpha)
    if fewest is None:
        return "never"
    return f"{fewest:,}" + (": more than it has, no build can pass" if c.pool and fewest > c.pool else "")


def can_tell(decision: Decision) -> list[str]:
    """Per task, before any build: what its documents can tell at its threshold (eval/quality/sequential.py)."""
    widest = {}
    for b in decision.builds:
        for task, c in b.tasks.items():
            if c.pool and c.n >= widest.get(task, c).n:
                widest[task] = c
    if not widest:
        return []
    return [
        "",
        "What each task can tell: a score in [0, 1] judged by betting cannot PASS even a build that scores every "
        "document as the baseline does before the documents below (docs/gate.md); a log-likelihood can at the first "
        "look where the spread is small.",
        "",
        "| task | judged by | documents | threshold | fewest a PASS takes |",
        "|---|---|---|---|---|",
        *(f"| {t} | {c.metric} | {c.pool:,} | {c.threshold:g} | {_fewest(c)} |" for t, c in widest.items()),
    ]


def documents_section(decision: Decision) -> list[str]:
    """Per build and task: the documents it was judged on, and how many its verdict needs at the observed
    effect and spread (eval/stats.samples_to_decide): what sizes a card's tasks."""
    rows = [
        f"| {b.precision} | {task} | {c.verdict} | {formats.documents(c)} | {c.n_to_decide or 0:,} | {_resolution(c)} "
        f"| {_reading(c)} |"
        for b in decision.builds
        for task, c in b.tasks.items()
    ]
    if not rows:
        return []
    return [
        "",
        "## Documents each verdict needs",
        "",
        "Documents: those the verdict was read on, of those the baseline scored; a build's task is scored in rounds "
        "until its verdict is known where the card's gate stops scoring. "
        "Where a task decided, the documents its sequence needed (at a look); where it did not, about how many would "
        "decide it at the observed effect and per-document spread (a near miss within "
        f"{NEAR_MISS}x). Resolution: how far from the threshold a build must be for the task's documents to decide "
        "it with 90 % power at this spread.",
        "",
        "| build | task | verdict | documents | needed | resolution | reading |",
        "|---|---|---|---|---|---|---|",
        *rows,
        *can_tell(decision),
    ]


def fits_section(card: ModelCard) -> list[str]:
    """The size stage's fits-on table for the card's target GPUs, as Markdown lines."""
    by_build = {p: s for p in card.precisions if (s := result_of(card.name, p, Sized))}
    sized = list(by_build.values())
    rows = [fit_cells(f) for s in sized for f in s.fits if f.gpu in card.target_gpus]
    if not rows:
        return []
    s, names = sized[0], list(rows[0])
    kv = s.assumptions.kv_dtype_bytes  # a KV-cache variant's entries differ from the first build's
    other = [
        f"{b.assumptions.kv_dtype_bytes}-byte for {p}"
        for p, b in by_build.items()
        if b.assumptions.kv_dtype_bytes != kv
    ]
    assumed = s.assumptions.describe()
    if other:
        assumed = assumed.replace("KV entries", f"KV entries ({', '.join(other)})")
    return [
        "",
        f"## Projected fit on the target GPUs (batch {s.batch}, {s.input_len} in / {s.output_len} out; {assumed})",
        "",
        "| " + " | ".join(names) + " |",
        "|" + "---|" * len(names),
        *("| " + " | ".join(r[n] for n in names) + " |" for r in rows),
    ]
