"""The gate's decision as data: a rule's verdict, what the gate measured of a build, each build's verdict,
and the decision (artifacts/<model>/gate.json).

pipelines/decision/ makes them; pipelines/tracking/ and pipelines/present/ read them. The verdicts
themselves are eval/quality/stats.py's `Verdict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from eval.quality.paired import Generation
from eval.quality.stats import Comparison, Flips, Verdict
from pipelines.core.card.cards import Gate
from pipelines.core.store.layout import gate_file
from pipelines.core.store.manifests import CodeVersion
from pipelines.core.store.results import Record
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import atomic_write
from quant.execution import Execution


@dataclass(frozen=True)
class Rule:
    """One rule of the policy applied to one build."""

    name: str  # a task name, speed, memory or fit
    verdict: Verdict  # PASS, FAIL, INCONCLUSIVE or NOT GATED
    reason: str


@dataclass(frozen=True)
class CostFigure:
    """A build's capacity and cost for the card's traffic on the device the gate judges cost on
    (pipelines/decision/pricing.py); usd_per_mtok None where there is no price or it cannot serve (`why`)."""

    device: str
    measured: bool  # False: projected
    users_per_instance: int
    devices: int | None  # devices the traffic needs
    usd_per_hour: float | None
    usd_per_mtok: float | None  # $ per million output tokens
    why: str | None = None
    # measured on intervals (eval/load/capacity.py, `bounds`): low to high, the optimistic end first; None in the
    # $ where that end holds no user for certain (or there is no price)
    devices_range: tuple[int | None, int | None] | None = None
    usd_per_mtok_range: tuple[float | None, float | None] | None = None
    at_most: str | None = None  # no level missed: the users a lower bound, the devices and $ upper bounds; why
    # at the card's per-user speed (`traffic.user_tps`), on the build's throughput-interactivity frontier
    # (pipelines/decision/pricing.py): $ per million output tokens at one instance's throughput there, and its
    # interval's ends (cheap, dear); what the gate judges wherever the card states that speed
    user_tps: float | None = None
    at_speed: tuple[float, float | None, float | None] | None = None
    at_speed_bound: bool = False  # every level gave each user more: the best of them, an upper bound on the $
    at_speed_why: str | None = None  # not priced at that speed: why
    too_slow: bool = False  # not priced because no level swept gave each user that speed

    @property
    def most(self) -> str:
        """ "at most " before a figure that is an upper bound, else ""."""
        return "at most " if self.at_most else ""

    def mtok_end(self, i: int) -> float | None:
        """End `i` of the $ per million output tokens range (0 optimistic, 1 conservative); None without one."""
        return self.usd_per_mtok_range[i] if self.usd_per_mtok_range else None

    @property
    def judged(self) -> float | None:
        """The $ per million output tokens choices rest on: the conservative end where there is a range; at the
        card's per-user speed where it states one (None where the build was not priced there)."""
        if self.user_tps is not None:
            return (self.at_speed[2] or self.at_speed[0]) if self.at_speed else None
        return self.usd_per_mtok_range[1] if self.usd_per_mtok_range else self.usd_per_mtok

    @property
    def optimistic(self) -> float | None:
        """The cheap end of what `judged` rests on (the figure itself where there is no interval)."""
        if self.user_tps is not None:
            return (self.at_speed[1] or self.at_speed[0]) if self.at_speed else None
        return self.usd_per_mtok_range[0] if self.usd_per_mtok_range else self.usd_per_mtok

    def speed_text(self) -> str:
        """The cost at the card's per-user speed, as the gate judges it; why not, where the card states one and the
        build was not priced there; "" where the card states none."""
        if self.user_tps is None:
            return self.at_speed_why or ""
        where = f"at {self.user_tps:g} output tokens/s per user"
        if self.at_speed is None:
            return f"{where}: not priced ({self.at_speed_why or 'no sweep on this device'})"
        point, cheap, dear = self.at_speed
        most = "at most " if self.at_speed_bound else ""
        ends = f" [${cheap:.3g}, ${dear:.3g}]" if cheap and dear else ""
        return f"{where}: {most}${point:.3g}{ends} per 1M output tokens (judged on ${self.judged:.3g})"

    def text(self) -> str:
        """The cost at the build's own edge; then, where the card states a per-user speed, the one judged."""
        speed = self.speed_text()
        return f"{self._edge_text()}; {speed}" if speed else self._edge_text()

    def _edge_text(self) -> str:
        where = "measured" if self.measured else "projected"
        if self.at_most:
            where += f"; no level missed, the sweep stopped at {self.at_most}"
        most = self.most
        if self.why:
            return f"on {self.device}: {self.why} ({where})"
        if self.usd_per_mtok is None:
            return f"on {self.device}: {most}{self.devices} devices, no price ({where})"
        if self.usd_per_mtok_range is None:
            return (
                f"{most}${self.usd_per_mtok:.3g} per 1M output tokens on {self.device} ({most}{self.devices} devices, "
                f"${self.usd_per_hour:,.2f}/h; {where})"
            )
        cheap, dear = (f"${x:.3g}" if x is not None else "none for certain" for x in self.usd_per_mtok_range)
        few, many = (str(n) if n is not None else "-" for n in self.devices_range or (None, None))
        judged = f"${self.judged:.3g}" if self.judged is not None else "no cost (no user for certain)"
        return (
            f"{most}${self.usd_per_mtok:.3g} [{cheap}, {dear}] per 1M output tokens on {self.device} ({self.devices} "
            f"[{few}, {many}] devices, ${self.usd_per_hour:,.2f}/h; {where}; judged on {judged}, the conservative end)"
        )


@dataclass(frozen=True)
class Measured:
    """What the gate judges of one build's speed and memory."""

    decode_tps: float  # engine: decode tokens/s per user at the policy's batch
    peak_gb: float  # engine: peak memory at the policy's batch
    weights_gb: float
    execution: Execution  # how the regime's figures ran: the engine bench's, or the server's
    regime: Literal["engine", "server"] = "engine"
    engine: str = ""  # engine: how generate() ran (cache, compiled or eager); server: the serving engine
    goodput: float | None = None  # server: requests/s that met the SLO at the judged users
    users_at_slo: int | None = None  # server: the most concurrent users that met the SLO
    users_range: tuple[int, int] | None = None  # server: those users on the levels' intervals (eval/load/serving.py)
    users_bound: str | None = None  # server: no level missed, users_at_slo a lower bound; why (eval/load/edge.py)
    cost: CostFigure | None = None  # where the card states its traffic

    @property
    def speed(self) -> float:
        """The figure the speed rule and the choice use, by the policy's regime."""
        return (self.goodput or 0.0) if self.regime == "server" else self.decode_tps


class BuildVerdict(Record):
    precision: str
    verdict: Verdict
    rules: list[Rule]
    tasks: dict[str, Comparison]
    speed: Measured
    speedup: float | None
    vs_ship: dict[str, Comparison] = Field({}, description="per task, against the shipped build (gate --against ship)")
    generation: dict[str, Generation] = Field(
        {}, description="per generative task: output length against the baseline's, and where outputs depart"
    )
    not_scored: dict[str, str] = Field({}, description="tasks its evaluation left unscored (gate.stop_scoring), why")
    flips: dict[str, Flips] = Field(
        {}, description="per multiple-choice task: answers that differ from the baseline's (shown, not gated)"
    )

    @property
    def reasons(self) -> list[str]:
        return [r.reason for r in self.rules]

    def worst_task(self) -> tuple[str, Comparison]:
        """The task that decides the build's quality: a failing task before an INCONCLUSIVE one before a
        passing one, and among equals the one that used the most of the loss its threshold allows. Not simply
        the lowest recovery: a task held to a lower threshold of its own (`gate.task_min_recovery`) can
        recover less and still pass while another decides the verdict."""
        return worst_of(self.tasks)


def worst_of(tasks: dict[str, Comparison]) -> tuple[str, Comparison]:
    """The deciding task of a build's comparisons (BuildVerdict.worst_task)."""
    task = min(tasks, key=lambda t: (_SEVERITY.get(tasks[t].verdict, 3), _room_left(tasks[t])))
    return task, tasks[task]


_SEVERITY = {Verdict.FAIL: 0, Verdict.INCONCLUSIVE: 1, Verdict.PASS: 2}


def _room_left(c: Comparison) -> float:
    """The share of the allowed loss the interval's unfavourable end leaves unused (negative: past the threshold):
    recovery down to `threshold` allows 1 - threshold, a perplexity increase allows `threshold`."""
    if c.rule == "recovery":
        return (c.recovery[1] - c.threshold) / max(1.0 - c.threshold, 1e-9)
    return (c.threshold - c.ppl_increase[2]) / max(c.threshold, 1e-9)  # type: ignore[index]


class Decision(Record):
    """Which build ships, why, and every build's verdict: gate.json."""

    model: str
    decided: str = Field(description="when, ISO 8601 (UTC)")
    policy: Gate
    speed_axis: str = Field(description="what the speed figures are, under the policy's regime")
    baseline: Measured
    builds: list[BuildVerdict]
    chosen: str | None
    why: str
    registered: dict[str, str] = Field({}, description="the Model Registry version behind alias `ship`")
    against: dict[str, str] = Field({}, description="gate --against ship: the version every build was compared with")
    code: CodeVersion


def write_decision(decision: Decision) -> Path:
    path = gate_file(decision.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, decision.model_dump_json(indent=2) + "\n")
    return path


def read_decision(model: str) -> Decision:
    """The decision the gate last made for `model`; a QevalError naming the fix when there is none."""
    path = gate_file(model)
    try:
        return Decision.model_validate_json(path.read_text())
    except OSError:
        raise QevalError(f"{model}: no gate decision at {path}; run: qeval gate --model {model}") from None
    except ValidationError as e:
        raise QevalError(
            f"{path} is not a gate decision of this qeval ({e.error_count()} errors); run: qeval gate --model {model}"
        ) from None
