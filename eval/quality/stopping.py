"""When to stop scoring a build that cannot ship: its tasks judged against the baseline's one by one.

A quantized build passes only when every task passes (pipelines/decision/policy.py), so once one task fails
the rest cannot change its verdict. With a stop rule, eval/quality/accuracy.py scores the build's tasks one at a time
and asks `first_stop` after each; the tasks left are recorded as not scored, with its reason. Each verdict is
the gate's own, from the same records and the same statistics (eval/quality/paired.py): the paired comparison under
the task's threshold, and for a generative task the length rule where the policy gates it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from eval.quality.paired import Bootstrap, Scored, Threshold, generation, paired
from eval.quality.records import AccuracyResult
from eval.quality.stats import Verdict


class TaskRule(BaseModel):
    """What one task is held to, as the card's gate says."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: Threshold
    metric: str | None = Field(None, description="the metric that judges it (None: the preferred)")
    control: str | None = Field(None, description="a task it is judged by its gain over")
    length_band: float | None = Field(
        None, description="generative: output length within this share of the baseline's (None: not gated)"
    )


class StopScoring(BaseModel):
    """Score a build's tasks one at a time and stop at the first that `when` names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    when: Literal["fail", "inconclusive"]
    rules: dict[str, TaskRule] = Field(description="per task of the card")
    bootstrap: Bootstrap
    baseline_folder: str = Field(description="the baseline's evaluation: its per-document records")
    baseline: AccuracyResult

    def key(self) -> dict:
        """What decides where scoring stops, the baseline's evaluation aside (its own digest stands in)."""
        return self.model_dump(mode="json", include={"when", "rules", "bootstrap"})


def first_stop(stop: StopScoring, folder: Path, scored: AccuracyResult, judged: set[str]) -> str | None:
    """Judge every task scored so far and not yet judged whose control is scored too (adding each to
    `judged`); the reason to stop at the first that fails (or is INCONCLUSIVE, when `stop.when` says so),
    else None."""
    base, build = Scored(Path(stop.baseline_folder), stop.baseline), Scored(folder, scored)
    stopping = {Verdict.FAIL} | ({Verdict.INCONCLUSIVE} if stop.when == "inconclusive" else set())
    for task, rule in stop.rules.items():
        if task in judged or task not in scored.scores or (rule.control and rule.control not in scored.scores):
            continue
        judged.add(task)
        for verdict, why in _verdicts(stop, base, build, task):
            if verdict in stopping:
                return why
    return None


def decided(stop: StopScoring, folder: Path, scored: AccuracyResult, tasks: list[str]) -> bool:
    """Whether the verdicts of `tasks` (scored so far, in rounds: eval/quality/rounds.py) are known: one FAILs, or every
    rule of every one PASSes."""
    base, build = Scored(Path(stop.baseline_folder), stop.baseline), Scored(folder, scored)
    verdicts = [v for task in tasks for v, _ in _verdicts(stop, base, build, task)]
    return Verdict.FAIL in verdicts or all(v == Verdict.PASS for v in verdicts)


def _verdicts(stop: StopScoring, base: Scored, build: Scored, task: str) -> list[tuple[Verdict, str]]:
    """The task's verdicts, each with what it says: its rule's and, where the policy gates it, its output
    length's; on the documents the build has scored (the first of the baseline's, where it stopped early)."""
    rule = stop.rules[task]
    c = paired(
        task,
        base,
        build,
        threshold=rule.threshold,
        bootstrap=stop.bootstrap,
        metric=rule.metric,
        control=rule.control,
        subset=True,
    )
    est, lo, hi = c.statistic
    out = [(c.verdict, f"{task} {c.verdict} ({c.metric} {est:.4g} [{lo:.4g}, {hi:.4g}] vs {c.threshold:g})")]
    if rule.length_band is None:
        return out
    g = generation(task, base, build, band=rule.length_band, bootstrap=stop.bootstrap, subset=True)
    if g is not None:
        est, lo, hi = g.length.ratio
        band = f"±{rule.length_band:.0%}"
        out.append(
            (g.length.verdict, f"{task} output length {g.length.verdict} ({est:.3f}x [{lo:.3f}, {hi:.3f}] vs {band})")
        )
    return out
