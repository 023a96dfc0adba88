"""How figures look to people: a colour per precision, a marker per verdict, units, one-line summaries.

A precision has one colour everywhere (report charts, the MLflow runs table's colour dot and its
charts); a verdict is never a colour but a marker shape and a word, so that a colour means one thing.
The colours are Okabe and Ito's set for colour-blind readers ("Color Universal Design", 2002).
"""

from __future__ import annotations

import re

from eval.load.serving import LevelMetrics
from eval.load.speedup import crossovers, within_noise
from eval.quality.stats import Comparison, Verdict
from pipelines.core.store.verdicts import BuildVerdict, Decision, Measured
from quant.execution import Execution
from quant.precisions import PRECISIONS

_BY_NAME = {"bf16": "#555555", "fp8": "#E69F00", "int8": "#0072B2", "awq": "#009E73", "gptq": "#CC79A7"}
_SPARE = ["#D55E00", "#56B4E9", "#F0E442", "#000000"]

# matplotlib markers: a filled circle passes, a square is undecided, a cross fails, a diamond is the baseline
VERDICT_MARKERS = {
    Verdict.PASS: "o",
    Verdict.INCONCLUSIVE: "s",
    Verdict.FAIL: "X",
    Verdict.NOT_GATED: "o",
    Verdict.BASELINE: "D",
}


def precision_colour(precision: str) -> str:
    """The precision's colour (#RRGGBB), the same in every chart and run."""
    if precision in _BY_NAME:
        return _BY_NAME[precision]
    others = [p for p in PRECISIONS if p not in _BY_NAME]
    index = others.index(precision) if precision in others else sum(map(ord, precision))
    return _SPARE[index % len(_SPARE)]


def literal(text: str) -> str:
    """Text a card gives (a path, a hub id, a data set) as a Markdown code span, which a Markdown or HTML
    renderer shows as written: no link, image or tag acts. The fence is one backtick longer than any run of
    them in the text (CommonMark, "Code spans"); a line break, which a span cannot hold, is a space."""
    flat = " ".join(str(text).splitlines())
    fence = "`" * (max((len(r) for r in re.findall(r"`+", flat)), default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") or not flat.strip() else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def size(gb: float) -> str:
    """A size in the unit that reads best: 3.1 MB, 1.25 GB, 141 GB."""
    if gb < 1:
        mb = gb * 1e3
        return f"{mb:.3g} MB" if mb >= 0.01 else f"{gb * 1e9:.3g} bytes"
    return f"{gb:.3g} GB" if gb < 100 else f"{gb:,.0f} GB"


def count(n: float, cap: float = 10_000) -> str:
    """A count people read: 3, 1,024, or "> 10,000" past `cap` (where only "plenty" is meant)."""
    return f"> {cap:,.0f}" if n > cap else f"{n:,.0f}"


def ms(value: float) -> str:
    """Milliseconds at a readable precision: 0.0015 -> "< 0.01", 12.345 -> "12.3", 2341.7 -> "2,342"."""
    if value < 0.01:
        return "< 0.01"
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


def users_count(n: int, bound: str | None = None) -> str:
    """ "5 users"; "at least 64 users" where no level missed and the sweep stopped at `bound` (eval/load/edge.py)."""
    return ("at least " if bound else "") + f"{n} user" + ("" if n == 1 else "s")


def arithmetic(dtype: str) -> str:
    """What vLLM computed in, from its --dtype as the serve and shape stages set it (engines.vllm_dtype)."""
    if dtype == "float32":
        return "computed in float32 (this CPU has no bf16 units: bf16 arithmetic would be emulated)"
    return "computed in the checkpoint's 16-bit dtype, native here" if dtype == "auto" else f"computed in {dtype}"


def emulated(execution: Execution) -> bool:
    """Whether figures that ran this way are drawn hollow and dashed: they say nothing of the format's speed."""
    return execution == Execution.EMULATED


def speed(m: Measured) -> str:
    """The speed figure the gate used, with its unit, and how it ran."""
    if m.regime == "server":
        users = "" if m.users_at_slo is None else f", {users_count(m.users_at_slo, m.users_bound)} within the SLO"
        figure = f"goodput {m.goodput or 0:.3g} req/s{users}"
    else:
        figure = f"{m.decode_tps:.4g} tok/s per user"
    return f"{figure} ({m.execution})"


def summary(decision: Decision, build: BuildVerdict | None) -> str:
    """One line on a build under the decision (None: the baseline): verdict, weights, worst recovery with its
    interval, speed. MLflow's runs table shows a description's first 50 characters (the rest on hover), so
    the verdict, the weights and the recovery come first."""
    if build is None:
        return f"BASELINE: {size(decision.baseline.weights_gb)} · {speed(decision.baseline)}"
    verdict = build.verdict + (", SHIPS" if build.precision == decision.chosen else "")
    task, worst = build.worst_task()
    rec, lo, hi = worst.recovery
    return (
        f"{verdict}: {size(build.speed.weights_gb)} · recovery {rec:.4f} [{lo:.4f}, {hi:.4f}] (worst: {task}) · "
        f"{speed(build.speed)}"
    )


def tps_with_interval(m: LevelMetrics) -> str:
    """A level's output tokens/s, with its interval over the requests where it has one: "183.2 [170.1, 195.0]"."""
    span = f" [{m.output_tps_lo:.1f}, {m.output_tps_hi:.1f}]" if m.output_tps_interval else ""
    return f"{m.output_tps or 0:.1f}{span}"


def crossing(ups: dict[int, float], baseline: str, spans: dict[int, tuple[float, float]] | None = None) -> str:
    """Where a build's speed-up over the baseline, level by level, crosses 1 (eval/load/speedup.py, crossovers),
    or that it never does; each crossing, and a level where faster and slower cannot be told apart, called
    within the noise on the speed-ups' intervals (`spans`); "-" without a level in common."""
    if not ups:
        return "-"
    if crossed := crossovers(ups, spans):
        return "; ".join(
            f"{what} at {c} users" + (" (within the noise)" if noise else "") for c, what, noise in crossed
        )
    said = f"{'faster' if min(ups.values()) > 1 else 'slower'} than {baseline} at every level swept"
    noisy = [c for c in sorted(ups) if within_noise((spans or {}).get(c))]
    users = "user" if noisy == [1] else "users"
    return said + (f" (within the noise at {', '.join(map(str, noisy))} {users})" if noisy else "")


def guarantee(decision: Decision) -> str:
    """What the quality verdicts guarantee, in one sentence: the report's and the ship card's."""
    g = decision.policy
    if g.verdicts != "sequential":
        return f"Each task is judged by a {g.confidence:.0%} paired bootstrap interval, valid read once."
    alphas = [c.alpha for b in decision.builds for c in b.tasks.values() if c.alpha]
    each = min(alphas, default=1 - g.confidence)
    builds = max(1, round((1 - g.confidence) / each))
    return (
        f"Each task is judged by a confidence sequence, valid at every look (every {g.look_every} documents, in one "
        f"seeded order): the chance that a build that ships is worse than its threshold on any gated task is at most "
        f"{1 - g.confidence:.0%}, split over the {builds} builds judged ({each:.2%} each)."
    )


def documents(c: Comparison) -> str:
    """How many documents judged a task, of how many the baseline scored, and why scoring stopped there: a task
    scored in rounds stops once its verdict is known (eval/quality/rounds.py), else at the end of its pool."""
    if c.pool is None:
        return f"{c.n:,}"
    why = "decided" if c.verdict != Verdict.INCONCLUSIVE else "pool spent"
    return f"{c.n:,} of {c.pool:,}, {why}"
