"""Two scorings of the same documents compared document by document: a build against its baseline (the
gate), or a build scored through its server against its offline scores (the serve stage).

Each side is an evaluation's folder of per-document records with the scores read from it
(eval/quality/accuracy.py); the statistics are eval/quality/stats.py's. Which metric judges a task and what threshold it
is held to are the caller's to say: a model card's gate policy gives both (pipelines/core/card/cards.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from eval.quality.records import AccuracyResult, Metric, answers, document_metrics, documents, generated
from eval.quality.sequential import scoring_order
from eval.quality.stats import Comparison, Flips, LengthBand, Rule, compare, flip_rate, is_likelihood, length_band

PREFERRED_METRICS = ("bits_per_byte", "acc_norm", "acc", "exact_match")
"""The metric a task is summed up by, and judged by unless the card names one: the first it reports."""


@dataclass(frozen=True)
class Scored:
    """An evaluation: the folder of its per-document records (`samples_<task>.jsonl`) and its scores."""

    folder: Path
    result: AccuracyResult


@dataclass(frozen=True)
class Threshold:
    """What a task is held to: a minimum recovery, or for a perplexity-type metric, where one is set, a
    maximum relative increase of perplexity."""

    min_recovery: float
    max_ppl_increase: float | None = None

    def rule(self, likelihood: bool) -> tuple[Rule, float]:
        """(rule, threshold) for a metric whose per-document values are log-likelihoods or not."""
        if likelihood and self.max_ppl_increase is not None:
            return "ppl_increase", self.max_ppl_increase
        return "recovery", self.min_recovery


@dataclass(frozen=True)
class Bootstrap:
    """How the paired intervals are drawn: a confidence sequence per build and task (eval/quality/sequential.py), read
    every `every` documents in the seeded scoring order, its chance of a wrong PASS the card's 1 - confidence
    split over the `builds` judged; `sequential` False: the paired bootstrap, read once. The bootstrap draws the
    intervals shown beside (the difference)."""

    confidence: float
    resamples: int
    seed: int
    builds: int = 1
    every: int = 100
    sequential: bool = True

    def sequence(self, pool: int) -> tuple[float, int, int] | None:
        """(alpha, every, pool) for eval/quality/stats.py, or None for the bootstrap."""
        return ((1 - self.confidence) / self.builds, self.every, pool) if self.sequential else None


def gating_metric(task: str, available: list[Metric], chosen: str | None = None) -> Metric:
    """The metric that judges `task`: `chosen` ("name" or "name,filter"), else the first of
    PREFERRED_METRICS reported. Its filter is `none` where lm-eval reports one, else the first it reports
    (gsm8k: strict-match). ValueError where the task has no per-document metric or not the one chosen."""
    if not available:
        raise ValueError(f"task '{task}' has no per-document metric to compare")
    by_name: dict[str, list[Metric]] = {}
    for m in available:
        by_name.setdefault(m.name, []).append(m)
    name, _, filt = (chosen or "").replace("/", ",").partition(",")
    if chosen and name not in by_name:
        raise ValueError(f"task '{task}' has no per-document '{name}'; it has: {sorted(by_name)}")
    name = name or next((n for n in PREFERRED_METRICS if n in by_name), next(iter(by_name)))
    candidates = by_name[name]
    return next((m for m in candidates if m.filter == (filt or "none")), candidates[0])


def paired(
    task: str,
    base: Scored,
    build: Scored,
    *,
    threshold: Threshold,
    bootstrap: Bootstrap,
    metric: str | None = None,
    subset: bool = False,
    control: str | None = None,
) -> Comparison:
    """One task's judging metric, `build` against `base` on the same documents.

    `metric`: the one chosen for the task (None: the preferred). `subset`: one side may have scored fewer
    documents than the other, compared on those (`_common`). `control`: a task of the same items without what
    `task` probes; then each document's value is its gain over the control's (a log-likelihood's, for a
    perplexity-type metric), and recovery is the build's total gain over the baseline's. Raises
    FileNotFoundError where a per-document record is missing, KeyError where the two were not scored on the
    same documents, ValueError where the task has no such metric.
    """
    m = gating_metric(task, document_metrics(base.folder, base.result, task), metric)
    base_docs = documents(base.folder, base.result, task, m)
    build_docs = documents(build.folder, build.result, task, m)
    name, higher = m.name, m.higher_is_better
    if control is not None:
        name = f"{'log-likelihood' if is_likelihood(list(base_docs.values())) else m.name} gain over {control}"
        base_docs, build_docs, higher = _gains(base, control, m, base_docs), _gains(build, control, m, build_docs), True
    pool = len(base_docs)
    docs = _common(task, base, build, base_docs, build_docs, subset, bootstrap.seed)
    base_v, build_v = [base_docs[d] for d in docs], [build_docs[d] for d in docs]
    rule, bound = threshold.rule(is_likelihood(base_v))
    return compare(
        name,
        base_v,
        build_v,
        higher_is_better=higher,
        rule=rule,
        threshold=bound,
        confidence=bootstrap.confidence,
        iters=bootstrap.resamples,
        seed=bootstrap.seed,
        sequence=bootstrap.sequence(pool),
    )


def flips(
    task: str,
    base: Scored,
    build: Scored,
    *,
    confidence: float,
    metric: str | None = None,
    subset: bool = False,
    seed: int = 0,
) -> Flips | None:
    """A multiple-choice task's answers, `build` against `base` on the same documents: how many changed, each
    picked as the task's judging metric picks it (`acc_norm`: per character); None where the task is not
    multiple-choice. KeyError where the two were not scored on the same documents."""
    m = gating_metric(task, document_metrics(base.folder, base.result, task), metric)
    normalised = m.name == "acc_norm"
    base_ans = answers(base.folder, base.result, task, normalised)
    build_ans = answers(build.folder, build.result, task, normalised)
    if not base_ans or not build_ans:
        return None
    docs = _common(task, base, build, base_ans, build_ans, subset, seed)
    return flip_rate([base_ans[d] for d in docs], [build_ans[d] for d in docs], confidence)


def _gains(side: Scored, control: str, m: Metric, docs: dict) -> dict:
    """Per document, its value's gain over the control's on the same item (by document id): for a
    perplexity-type metric the difference of the log-likelihoods (nats), else of the scores, signed so that
    more is better."""
    ctl = {d: v for (_, d), v in documents(side.folder, side.result, control, m).items()}
    if {d for _, d in docs} != ctl.keys():
        raise KeyError(control)
    sign = 1 if m.higher_is_better else -1
    return {(t, d): v[0] - ctl[d][0] if isinstance(v, tuple) else sign * (v - ctl[d]) for (t, d), v in docs.items()}


@dataclass(frozen=True)
class Departures:
    """Where greedy outputs first depart from the baseline's, per document, in generated tokens (0: the
    first token differs); None where the two outputs are the same tokens. An early departure on many
    documents shows before any metric moves."""

    positions: list[int | None]

    @property
    def identical(self) -> int:
        return sum(p is None for p in self.positions)

    @property
    def quartiles(self) -> tuple[float, float, float] | None:
        """Quartiles of the position among the documents that depart (None: none departs)."""
        departed = [p for p in self.positions if p is not None]
        if not departed:
            return None
        q1, q2, q3 = statistics.quantiles(departed, n=4, method="inclusive") if len(departed) > 1 else [departed[0]] * 3
        return float(q1), float(q2), float(q3)

    @property
    def median(self) -> float | None:
        q = self.quartiles
        return q[1] if q else None

    def text(self) -> str:
        n, same = len(self.positions), self.identical
        where = f"median departure at token {self.median:g}" if self.median is not None else "none departs"
        return f"{where}, {same} of {n} outputs identical"


def departure(base: list[int], build: list[int]) -> int | None:
    """The first token position where `build` differs from `base`; None where they are the same tokens
    (one output a prefix of the other departs where the shorter ends)."""
    for i, (a, b) in enumerate(zip(base, build, strict=False)):
        if a != b:
            return i
    return None if len(base) == len(build) else min(len(base), len(build))


@dataclass(frozen=True)
class Generation:
    """A generative task, build against baseline: output length and greedy agreement."""

    length: LengthBand
    departures: Departures


def _outputs(
    task: str, base: Scored, build: Scored, subset: bool, seed: int = 0
) -> tuple[list[tuple[list[int], list[int]]], int] | None:
    """(baseline's, build's) generated token ids per document, in one order, and how many documents the baseline
    generated for; None where the task does not generate. KeyError where the two were not scored on the same
    documents."""
    base_ids, build_ids = generated(base.folder, base.result, task), generated(build.folder, build.result, task)
    if not base_ids:
        return None
    docs = _common(task, base, build, base_ids, build_ids, subset, seed)
    return [(base_ids[d], build_ids[d]) for d in docs], len(base_ids)


def _common(task: str, base: Scored, build: Scored, base_docs: dict, build_docs: dict, subset: bool, seed: int) -> list:
    """The documents both sides scored, in the scoring order (eval/quality/sequential.py). Without `subset` the two must
    hold the same documents. With it one side may hold fewer: where either side scored the task in rounds
    (eval/quality/rounds.py), the first of the other's in that order (a build that stopped when its verdict was known, a
    cross-check's first documents), else any of the other's (a cross-check's first by index). KeyError where
    they do not."""
    order = scoring_order(list(base_docs.keys() | build_docs.keys()), seed)
    short, other = sorted((base_docs, build_docs), key=len)
    rounds = [(side.result.rounds.get(task), docs) for side, docs in ((base, base_docs), (build, build_docs))]
    if any(took is not None and took.scored != len(docs) for took, docs in rounds):
        fits = False  # a record lost: not what the rounds scored
    elif not subset:
        fits = base_docs.keys() == build_docs.keys()
    elif any(took is not None for took, _ in rounds):
        fits = short.keys() <= other.keys() and short.keys() == set(order[: len(short)])
    else:
        fits = short.keys() <= other.keys()
    if not fits or not short:
        raise KeyError(task)
    return [d for d in order if d in short]


def agreement(task: str, base: Scored, build: Scored, *, subset: bool = False, seed: int = 0) -> Departures | None:
    """Where a generative task's outputs depart from `base`'s, document by document (None: it does not
    generate)."""
    found = _outputs(task, base, build, subset, seed)
    return None if found is None else Departures([departure(a, b) for a, b in found[0]])


def generation(
    task: str, base: Scored, build: Scored, *, band: float, bootstrap: Bootstrap, subset: bool = False
) -> Generation | None:
    """Output lengths (generated tokens) and departures of a generative task on the same documents; None
    where the task does not generate. KeyError where the two were not scored on the same documents."""
    found = _outputs(task, base, build, subset, bootstrap.seed)
    if found is None:
        return None
    pairs, pool = found
    lengths = length_band(
        [len(a) for a, _ in pairs],
        [len(b) for _, b in pairs],
        band=band,
        confidence=bootstrap.confidence,
        iters=bootstrap.resamples,
        seed=bootstrap.seed,
        sequence=bootstrap.sequence(pool),
    )
    return Generation(lengths, Departures([departure(a, b) for a, b in pairs]))
