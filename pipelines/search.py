"""`qeval search`: the cheapest mixed-precision build that passes (issue 43).

The card's `search:` names a target precision (most layers) and a fallback (the most sensitive layer groups).
1. The target's layer groups are ranked by what quantizing each alone costs, and the frontier of mixes is
   predicted: for k = 0 .. all groups kept at the fallback, the divergence from the baseline and the weight
   bytes (the sensitivity stage, pipelines/stages/sensitivity.py).
2. The uniform builds at the frontier's ends are judged first, by the gate's quality rules (their paired task
   verdicts, output lengths, unscored tasks; pipelines/decision/gate.py `quality`). Where the target passes,
   no layer needs keeping; where the fallback fails, no mix of it can pass: nothing is built. Only mixes
   smaller than the smallest uniform build that passes, and within the card's budget, are tried.
3. The first mix built is the one predicted to pass at the fewest bytes: the fewest groups kept whose predicted
   divergence closes GAP_CLOSED of the gap between the uniform target's and the uniform fallback's. Then
   bisection on k, the gate's verdict the judge (a mix that passes bounds k from above, one that fails from
   below), at most `search.max_evaluations` builds. A verdict the tasks cannot decide (INCONCLUSIVE) stops the
   search: more builds would not decide either, more documents would (the reason says how many).
Each mix is a real compressed-tensors checkpoint with two config groups (quant/recipes.py `mixed`), built,
proven layer by layer and evaluated like any build, with its own MLflow run. The chosen mix (else the last
tried) goes on through the pipeline (bench, size, serve) and the gate with the uniform builds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from eval.quality.stats import Verdict
from pipelines.core.card.cards import ModelCard
from pipelines.core.card.search import Search
from pipelines.core.framework.tracker import Tracker
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Evaluated, Quantized
from pipelines.core.store.results.ranked import Candidate, Ranked
from pipelines.core.store.searches import Searched, Tried, write_search
from pipelines.core.store.verdicts import worst_of
from pipelines.core.system.errors import QevalError
from pipelines.decision.gate import quality
from pipelines.stages.evaluate import evaluate
from pipelines.stages.quantize import quantize
from pipelines.stages.sensitivity import sensitivity
from quant.precisions import get_precision, mix_name

log = logging.getLogger(__name__)

GAP_CLOSED = 0.9
"""The first mix tried closes this share of the predicted divergence between the uniform target and the uniform
fallback: a guess the bisection corrects, not a threshold anything passes by."""


def bisect(first: int, lo: int, hi: int, judge: Callable[[int], Verdict], budget: int) -> tuple[int | None, str]:
    """The fewest groups kept, in [lo, hi], that `judge` passes, assuming it is monotone (keeping more groups
    never makes a passing mix fail): `first` is tried first, then the middle of what is left. At most `budget`
    calls, and at most 1 + ceil(log2(hi - lo + 1)) of them. Returns (the smallest passing k found, or None;
    why the search stopped)."""
    best, k, spent = None, min(max(first, lo), hi), 0
    while lo <= hi:
        if spent == budget:
            return best, f"the {budget} evaluation{'s' if budget != 1 else ''} the card allows spent"
        verdict = judge(k)
        spent += 1
        if verdict == Verdict.PASS:
            best, hi = k, k - 1
        elif verdict == Verdict.FAIL:
            lo = k + 1
        else:
            return best, f"the tasks cannot decide a mix keeping {k} groups ({verdict})"
        k = (lo + hi) // 2
    return best, "bisection done" if best is not None else "every mix within the budget fails"


def with_build(card: ModelCard, precision: str) -> ModelCard:
    """The card with one more build (a mix) among its precisions."""
    return (
        card if precision in card.precisions else card.model_copy(update={"precisions": [*card.precisions, precision]})
    )


def search(card: ModelCard, tracker: Tracker, *, force: bool = False) -> Searched:
    """Run the card's search; the record goes to artifacts/<model>/search.json."""
    s = card.search
    if s is None:
        raise QevalError(f"model '{card.name}' has no search section in its card (docs/cards.md, `search:`)")
    for p in dict.fromkeys([card.gate.baseline, s.target, s.fallback]):
        quantize(card, p, tracker)
        evaluate(card, p, tracker)
    ranked = sensitivity(card, s.target, tracker, force=force).result
    frontier, n = ranked.frontier, len(ranked.ranked)
    ends = {s.target: frontier[0], s.fallback: frontier[-1]}
    uniform = [
        _judged(card, p, ends[p].kept if p in ends else -1, ends[p].predicted_kl if p in ends else None)
        for p in card.precisions
        if _is_uniform_build(card, p)
    ]
    allowed, why = candidates(s, frontier, uniform, card.gate.baseline)
    tried: list[Tried] = []
    first = None
    if allowed:
        first = first_guess(ranked, allowed)

        def judge(k: int) -> Verdict:
            name = mix_name(s.target, k, s.fallback)
            log.info("%s search: building and evaluating %s (%d of %d groups at %s)", card.name, name, k, n, s.fallback)
            mixed = with_build(card, name)
            quantize(mixed, name, tracker, force=force)
            evaluate(mixed, name, tracker, force=force)
            tried.append(_judged(mixed, name, k, frontier[k].predicted_kl))
            log.info("%s search: %s %s (%s)", card.name, name, tried[-1].verdict, tried[-1].reason)
            return tried[-1].verdict

        best, stopped = bisect(first, min(allowed), max(allowed), judge, s.max_evaluations)
        why = _why(card, best, stopped, tried, uniform)
    passing = [t for t in tried if t.verdict == Verdict.PASS]
    chosen = min(passing, key=lambda t: t.weight_bytes).precision if passing else None
    found = Searched(
        model=card.name,
        target=s.target,
        fallback=s.fallback,
        groups=n,
        most_sensitive=[g.group for g in ranked.ranked[:5]],
        top_half_kl=ranked.top_half_kl,
        bottom_half_kl=ranked.bottom_half_kl,
        frontier=frontier,
        first=first,
        uniform=uniform,
        tried=tried,
        max_evaluations=s.max_evaluations,
        chosen=chosen,
        carried=chosen or (tried[-1].precision if tried else None),
        why=why,
    )
    write_search(found)
    log.info("%s search: %s", card.name, why)
    return found


def candidates(s: Search, frontier: list[Candidate], uniform: list[Tried], baseline: str) -> tuple[list[int], str]:
    """The groups kept of the mixes worth building (within the card's budget, and fewer bytes than the smallest
    uniform build that passes), and why none is where none is."""
    verdicts = {t.precision: t.verdict for t in uniform} | {baseline: Verdict.PASS}
    if verdicts.get(s.target) == Verdict.PASS:
        return [], f"{s.target} passes as it is: no layer needs keeping at {s.fallback}"
    if verdicts.get(s.fallback) == Verdict.FAIL:
        return [], f"{s.fallback} itself fails: no mix of it with {s.target} can pass"
    within = [c for c in frontier[1:-1] if _within(s, c.weight_bytes, c.effective_bits)]
    smallest = min((t for t in uniform if t.verdict == Verdict.PASS), key=lambda t: t.weight_bytes, default=None)
    allowed = [c.kept for c in within if smallest is None or c.weight_bytes < smallest.weight_bytes]
    if not within:
        return [], "no mix is within the card's budget (search.max_weight_gb, search.max_effective_bits)"
    if not allowed:
        return [], (
            f"{smallest.precision} passes with {smallest.weight_bytes / 1e6:.2f} MB of weights, fewer than any mix of "
            f"{s.target} with {s.fallback} would take"
        )
    return allowed, ""


def first_guess(ranked: Ranked, allowed: list[int]) -> int:
    """The fewest groups kept, among `allowed`, whose predicted divergence closes GAP_CLOSED of the gap between
    the uniform target's (none kept) and the uniform fallback's (all kept); the most allowed where none does."""
    ends = ranked.frontier[0].predicted_kl, ranked.frontier[-1].predicted_kl
    bar = ends[1] + (1 - GAP_CLOSED) * (ends[0] - ends[1])
    return next((k for k in sorted(allowed) if ranked.frontier[k].predicted_kl <= bar), max(allowed))


def _is_uniform_build(card: ModelCard, precision: str) -> bool:
    p = get_precision(precision)
    return precision != card.gate.baseline and not p.mix and result_of(card.name, precision, Evaluated) is not None


def _within(s: Search, weight_bytes: float, bits: float) -> bool:
    return (s.max_weight_gb is None or weight_bytes <= s.max_weight_gb * 1e9) and (
        s.max_effective_bits is None or bits <= s.max_effective_bits
    )


def _judged(card: ModelCard, precision: str, kept: int, predicted: float | None) -> Tried:
    """A build judged by the gate's quality rules, with its real weight bytes (`kept`: its groups at the fallback,
    -1 for a uniform build off the frontier)."""
    q = quality(card, precision)
    built = result_of(card.name, precision, Quantized)
    worst = worst_of(q.tasks) if q.tasks else None
    # the rule that decided: the worst task's where it carries the verdict, else the first with the verdict
    deciding = next((r for r in q.rules if worst and r.name == worst[0] and r.verdict == q.verdict), None)
    deciding = deciding or next((r for r in q.rules if r.verdict == q.verdict), None)
    return Tried(
        precision=precision,
        kept=kept,
        weight_bytes=float(built.checkpoint_bytes) if built else 0.0,
        predicted_kl=predicted,
        verdict=q.verdict,
        worst_task=worst[0] if worst else None,
        worst=tuple(worst[1].recovery) if worst else None,
        reason=deciding.reason if deciding else "",
    )


def _why(card: ModelCard, best: int | None, stopped: str, tried: list[Tried], uniform: list[Tried]) -> str:
    """One line: the mix found and what it saves against the smallest uniform build that passes, or why none."""
    s = card.search
    passing = sorted((t for t in uniform if t.verdict == Verdict.PASS), key=lambda t: t.weight_bytes)
    if best is not None:
        name = mix_name(s.target, best, s.fallback)
        mine = next(t for t in tried if t.precision == name)
        than = (
            f", against {passing[0].precision}'s {passing[0].weight_bytes / 1e6:.2f} MB, the smallest uniform build "
            f"that passes"
            if passing
            else f"; none of the {len(uniform)} uniform builds judged passes"
        )
        return f"{name} passes with {mine.weight_bytes / 1e6:.2f} MB of weights{than} ({stopped})"
    last = tried[-1] if tried else None
    detail = f": {last.reason}" if last and last.reason else ""
    return f"no mix passes: {stopped}{detail}"
