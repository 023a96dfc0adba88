"""A card's gate section (`gate:`): the policy that decides which quantized build ships.

pipelines/decision/ applies it; the card (pipelines/core/card/cards.py) checks it against the card's tasks, grid
and GPUs.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from eval.quality.paired import Bootstrap, Threshold
from pipelines.core.card.names import DeviceName, GpuName, PrecisionName, TaskName


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PositiveInt = Annotated[int, Field(gt=0)]
METRIC_FORM = r"^[A-Za-z0-9_][A-Za-z0-9_.,\-]{0,99}$"
"""lm-eval metric names (acc_norm, exact_match, bits_per_byte)."""


class Gate(_Strict):
    """The policy that decides which quantized build ships (pipelines/decision/ applies it).

    A build passes when every task passes its quality rule at `confidence`, and the speed and memory
    rules pass. Among passing builds the fastest at `speed_batch` ships (`prefer: speed`; speeds within
    `tie_tolerance` count as equal and go to the smaller weights), or the smallest (`prefer: memory`;
    ties to the faster), or the cheapest per million output tokens for the card's traffic on `cost_on`
    (`prefer: cost`; ties to the smaller weights); `max_cost_per_mtok` bounds that cost.
    """

    baseline: PrecisionName = Field("bf16", description="precision every build is compared with")
    min_recovery: float = Field(0.99, gt=0, le=1.5, description="quantized / baseline score, at least")
    task_min_recovery: dict[TaskName, float] = Field({}, description="per-task overrides of min_recovery")
    max_ppl_increase: float | None = Field(
        None, gt=0, description="perplexity tasks: relative perplexity increase allowed instead of min_recovery"
    )
    task_metric: dict[TaskName, Annotated[str, Field(pattern=METRIC_FORM)]] = Field(
        {}, description="metric that gates a task (default: bits_per_byte, acc_norm, acc, exact_match, first)"
    )
    controls: dict[TaskName, TaskName] = Field(
        {},
        description="a task judged by its gain over another (its control: the same "
        "items without what it probes), document by document",
    )
    max_length_change: float | None = Field(
        0.10,
        gt=0,
        lt=1,
        description="generative tasks: total output length within this fraction of the baseline's (MLPerf's 10 %)",
    )
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1.0,
        description="1 - the chance that a build that ships is worse than a threshold on any gated task (split "
        "over the builds judged); the paired tests' level",
    )
    verdicts: Literal["sequential", "bootstrap"] = Field(
        "sequential",
        description="sequential: each task judged by a confidence sequence, valid at every look "
        "(eval/quality/sequential.py); bootstrap: a paired bootstrap interval at `confidence`, valid read once",
    )
    look_every: PositiveInt = Field(100, description="documents between the looks of a confidence sequence")
    bootstrap_resamples: PositiveInt = Field(2000, description="resamples of the documents per paired bootstrap")
    bootstrap_seed: int = Field(0, description="seed of the paired bootstrap")
    speed_regime: Literal["engine", "server"] = Field(
        "engine",
        description="engine: decode tokens/s per user at speed_batch; server: goodput (requests/s that met "
        "the SLO) at speed_users concurrent users",
    )
    speed_batch: PositiveInt = Field(
        1, description="engine batch size (from speed.batch_sizes) that speed and memory are judged at"
    )
    speed_users: PositiveInt | None = Field(
        None, description="server regime: concurrency judged (from speed.concurrency; default the highest)"
    )
    min_speedup: float | None = Field(
        1.0, gt=0, description="decode speed-up over the baseline at speed_batch, at least (null: not gated)"
    )
    memory_budget_gb: float | None = Field(None, gt=0, description="peak memory at speed_batch allowed, GB")
    must_fit: list[GpuName] = Field(
        [], description="GPUs (catalog names) each build must fit on one of, at the largest batch of the grid"
    )
    prefer: Literal["speed", "memory", "cost"] = Field("speed", description="how to choose among passing builds")
    max_cost_per_mtok: float | None = Field(
        None, ge=1e-6, le=1e6, allow_inf_nan=False, description="$ per million output tokens on cost_on, at most"
    )
    cost_on: DeviceName | None = Field(None, description="device kind costs are judged on (null: the first target GPU)")
    tie_tolerance: float = Field(0.03, ge=0, lt=1, description="relative difference that counts as a tie")
    stop_scoring: Literal["never", "fail", "inconclusive"] = Field(
        "never",
        description="fail: a quantized build's tasks are scored one at a time and scoring stops once one fails "
        "(its rule or its length rule), as it then cannot ship; inconclusive: also once one is INCONCLUSIVE. The "
        "tasks left are recorded as not scored, with the reason. never: every task, in one lm-eval run",
    )

    def threshold(self, task: str) -> Threshold:
        """What `task` is held to: its own min recovery where set, else min_recovery, or for a
        perplexity-type metric max_ppl_increase where set."""
        if task in self.task_min_recovery:
            return Threshold(self.task_min_recovery[task])
        return Threshold(self.min_recovery, self.max_ppl_increase)

    @property
    def bootstrap(self) -> Bootstrap:
        """How the paired intervals of one build are drawn, judged alone (a card's builds: ModelCard.bootstrap)."""
        return self.judging(1)

    def judging(self, builds: int) -> Bootstrap:
        """How the paired intervals are drawn where `builds` builds are judged: each build's share of the chance
        of a wrong PASS (Bonferroni), so that over all of them it is at most 1 - confidence."""
        return Bootstrap(
            self.confidence,
            self.bootstrap_resamples,
            self.bootstrap_seed,
            builds=builds,
            every=self.look_every,
            sequential=self.verdicts == "sequential",
        )
