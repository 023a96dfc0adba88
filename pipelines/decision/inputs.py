"""What the gate reads of the stages: their typed results, and the per-document records of evaluate.

Turns them into the paired task comparisons (eval/quality/paired.py, under the card's thresholds) and the speed and
memory figures the policy (policy.py) judges. Every missing or mismatched input is one error naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from eval.devices.sizing import Fit
from eval.load.serving import LevelMetrics
from eval.quality.paired import Generation, Scored, flips, generation, paired
from eval.quality.stats import Comparison, Flips
from pipelines.core.card.cards import ModelCard
from pipelines.core.card.search import judging
from pipelines.core.framework.registry import require
from pipelines.core.store.layout import stage_dir
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Benched, Evaluated, Served, Sized
from pipelines.core.store.verdicts import Measured
from pipelines.core.system.errors import QevalError
from pipelines.decision.pricing import cost_figure, with_speed


def measured(card: ModelCard, precision: str) -> tuple[Measured, float]:
    """The build's speed and memory at the policy's batch, its weights as it ships, its cost for the card's
    traffic (where it states one), and the weight bytes the engine bench's decode steps read (for the check
    of a decode speed-up against them)."""
    bench = require(card, precision, Benched, "gate")
    where = f"gate: {card.name}@{precision} bench"
    if bench.config.no_weights:
        raise QevalError(f"{where} used random weights (--no-weights); bench the checkpoint: qeval bench")
    b = card.gate.speed_batch
    point = bench.at(b)
    if point is None or point.decode_tps_per_user is None or point.peak_mem_bytes is None:
        raise QevalError(f"{where} has no decode speed at batch {b} (out of memory there, or another grid)")
    # the build's weights as it ships, its weight files (the size stage's): the engine bench's resident bytes
    # are what its own (dequantizing) decode steps read, 16-bit for every low-bit format on transformers
    sized = require(card, precision, Sized, "gate")
    served = _served(card, precision)
    swept = served is not None and bool(served.per_level)  # a build not served here has no level to judge
    server_regime = card.gate.speed_regime == "server" and served is not None
    m = Measured(
        decode_tps=point.decode_tps_per_user,
        peak_gb=point.peak_mem_bytes / 1e9,
        weights_gb=sized.weights_bytes / 1e9,
        # the regime's own: how the server ran it (vLLM's kernels) or the engine bench
        execution=served.execution if server_regime else bench.engine.execution,
        regime=card.gate.speed_regime,
        engine=served.engine if server_regime else bench.engine.engine,
        goodput=_level(card, precision, served).goodput_rps if swept else None,
        users_at_slo=served.max_users_at_slo if served else None,
        users_range=served.users_at_slo_interval if served else None,
        users_bound=served.users_bound if served else None,
        cost=with_speed(card, precision, cost_figure(card, precision)),
    )
    return m, float(bench.engine.weight_bytes)


def _served(card: ModelCard, precision: str) -> Served | None:
    """The build's server sweep (required under the server regime, shown where it exists otherwise)."""
    if card.gate.speed_regime == "server":
        return require(card, precision, Served, "gate")
    return result_of(card.name, precision, Served)


def _level(card: ModelCard, precision: str, served: Served) -> LevelMetrics:
    level = served.per_level.get(card.judged_users)
    if level is None:
        raise QevalError(
            f"gate: {card.name}@{precision} serve has no level at {card.judged_users} users; rerun qeval serve"
        )
    return level


def fits(card: ModelCard, precision: str) -> list[Fit]:
    """The sizing projection on each GPU the policy requires a fit on, from the size stage."""
    sized = require(card, precision, Sized, "gate")
    projected = {f.gpu: f for f in sized.fits}
    missing = [g for g in card.gate.must_fit if g not in projected]
    if missing or (sized.batch, sized.input_len, sized.output_len) != (
        card.speed.largest_batch,
        card.speed.input_len,
        card.speed.output_len,
    ):
        raise QevalError(
            f"gate: {card.name}@{precision} was sized for other GPUs or another grid; rerun: "
            f"qeval size --log --model {card.name} --precision {precision}"
        )
    return [projected[g] for g in card.gate.must_fit]


T = TypeVar("T")


def evaluation(card: ModelCard, precision: str) -> tuple[Scored, Evaluated]:
    """A build's finished evaluation: its per-document records and scores, and the stage's result."""
    done = require(card, precision, Evaluated, "gate")
    return Scored(stage_dir(card.name, precision, Evaluated.STAGE), done.accuracy), done


def task_comparisons(card: ModelCard, precision: str) -> dict[str, Comparison]:
    """The paired comparison of every task of the card between the build and the baseline."""
    return paired_with(card, precision, evaluation(card, card.gate.baseline), "the baseline")


def paired_with(
    card: ModelCard, precision: str, other: tuple[Scored, Evaluated], who: str = "the shipped build"
) -> dict[str, Comparison]:
    """Every task of the card, the build against `other` (the baseline's or the shipped build's evaluation)."""
    build, done = evaluation(card, precision)
    if done.settings != other[1].settings:
        raise QevalError(
            f"gate: {card.name}@{precision} was evaluated with other settings than {who}; rerun both "
            f"with the card's settings: qeval run --model {card.name}"
        )
    gate, out = card.gate, {}
    for task in scored_tasks(card, done, other[1]):
        try:
            out[task] = paired(
                task,
                other[0],
                build,
                threshold=gate.threshold(task),
                bootstrap=judging(card),
                metric=gate.task_metric.get(task),
                control=gate.controls.get(task),
                subset=in_rounds(done),
            )
        except FileNotFoundError as e:
            raise QevalError(f"gate: {e}; rerun: qeval evaluate --force") from None
        except KeyError:
            raise QevalError(f"gate: {card.name}@{precision} {task}: not {who}'s documents; rerun evaluate") from None
        except ValueError as e:
            chosen = " (gate.task_metric in the card)" if task in gate.task_metric else ""
            raise QevalError(f"gate: {e}{chosen}") from None
    return out


def not_scored(card: ModelCard, precision: str) -> dict[str, str]:
    """The card's tasks the build's evaluation, or the baseline's, left unscored (`gate.stop_scoring`, or a task
    that failed in vLLM), with why; a task judged by its gain over a control left unscored counts as one too."""
    left = dict(evaluation(card, precision)[1].accuracy.not_scored)
    if precision != card.gate.baseline:  # a task the baseline could not score has nothing to compare with
        base = evaluation(card, card.gate.baseline)[1].accuracy.not_scored
        left |= {t: f"the baseline's: {why}" for t, why in base.items() if t not in left}
    for task in card.accuracy.tasks:
        if task not in left and (control := card.gate.controls.get(task)) in left:
            left[task] = f"judged by its gain over {control}, which was not scored"
    return left


def scored_tasks(card: ModelCard, *sides: Evaluated) -> list[str]:
    """The card's tasks every side scored, and each one a task judged by its gain over needs: a task left
    unscored by a build that stopped scoring has no comparison."""
    left = {t for side in sides for t in side.accuracy.not_scored}
    return [t for t in card.accuracy.tasks if t not in left and card.gate.controls.get(t) not in left]


def generations(card: ModelCard, precision: str) -> dict[str, Generation]:
    """Every generative task of the card, the build against the baseline: output length and departures."""
    band = card.gate.max_length_change or 0.10  # shown at MLPerf's band where the policy does not gate it
    return _each_task(
        card, precision, lambda t, a, b, subset: generation(t, a, b, band=band, bootstrap=judging(card), subset=subset)
    )


def answer_flips(card: ModelCard, precision: str) -> dict[str, Flips]:
    """Every multiple-choice task of the card, the build against the baseline: how many answers changed."""
    gate = card.gate
    return _each_task(
        card,
        precision,
        lambda t, a, b, subset: flips(
            t, a, b, confidence=gate.confidence, metric=gate.task_metric.get(t), subset=subset, seed=gate.bootstrap_seed
        ),
    )


def in_rounds(done: Evaluated) -> bool:
    """Whether the evaluation scored its tasks in rounds (eval/quality/rounds.py): then a build holds the first of the
    baseline's documents in the gate's order where its verdict was known before its pool was spent, and is
    compared on those."""
    return done.config.rounds is not None


def _each_task(
    card: ModelCard, precision: str, compare: Callable[[str, Scored, Scored, bool], T | None]
) -> dict[str, T]:
    """`compare(task, baseline, build, subset)` for every task both scored, where it applies (None: it does not);
    `subset`: the build was scored in rounds (`in_rounds`)."""
    base, (build, done) = evaluation(card, card.gate.baseline), evaluation(card, precision)
    out = {}
    for task in scored_tasks(card, done, base[1]):
        try:
            found = compare(task, base[0], build, in_rounds(done))
        except KeyError:
            raise QevalError(
                f"gate: {card.name}@{precision} {task}: not the baseline's documents; rerun evaluate"
            ) from None
        if found is not None:
            out[task] = found
    return out
