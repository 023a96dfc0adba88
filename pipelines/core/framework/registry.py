"""The stage registry: every fact about a stage in one place, in the order `qeval run` runs them.

A stage's name is its folder under artifacts/<model>/<precision>/, its MLflow tag `qeval.stage.<name>`
and the word `qeval run --skip` takes. The run order (pipelines/run.py), the Ray fan-out
(pipelines/fanout.py), the read-back from the store (pipelines/tracking/readback.py), the stage framework's
cache key (pipelines/core/framework/runner.py: the code of `function`'s module and what it imports) and the error
that names the command to run all read it from here. Functions are named by import path, so that this
module imports no stage.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pipelines.core.store.layout import stage_dir
from pipelines.core.store.manifests import finished, not_as_left
from pipelines.core.store.results import AtShape, Benched, Evaluated, Quantized, Served, Sized, StageResult
from pipelines.core.store.results.ranked import Ranked
from pipelines.core.system.errors import QevalError
from quant.lookup import lookup

if TYPE_CHECKING:
    from pipelines.core.card.cards import ModelCard

R = TypeVar("R", bound=StageResult)


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One stage of a build (every field by name: its booleans say nothing by position)."""

    name: str
    result: type[StageResult]
    needs_baseline: bool
    """A quantized build's run of it reads the baseline's (recovery, speed-up): the baseline's comes first."""
    judged: bool
    """The gate and the report read it (and read it back from the tracking store where this machine lacks it)."""
    needs_weights: bool = True
    """It reads the build's weights; the speed half of a card whose weights are not reachable runs the others."""
    full_run: bool = True
    """`qeval run` runs it for a card whose weights are reachable."""
    function: str = ""
    """`module:function` that runs it: (card, precision, tracker, *, force, ...) -> StageRecord; by default
    the function of its name in pipelines/stages/ of its name."""
    command: str = ""
    """The qeval command that runs it for one build (`qeval <command> --model M --precision P`); by default
    `stage <name>` (pipelines/cli_stages.py runs every registered stage by its name)."""
    make_target: str = ""
    """Its Make target; by default `stage` (`make stage STAGE=<name>`)."""

    def __post_init__(self) -> None:
        defaults = {
            "function": f"pipelines.stages.{self.name}:{self.name}",
            "command": f"stage {self.name}",
            "make_target": "stage",
        }
        for field, default in defaults.items():
            if not getattr(self, field):
                object.__setattr__(self, field, default)

    @property
    def module(self) -> str:
        return self.function.partition(":")[0]

    def load(self) -> Callable:
        """The stage's function (its module is imported now, not when the registry is)."""
        module, _, name = self.function.partition(":")
        return getattr(importlib.import_module(module), name)


# The stages of the first release have commands of their own, with their options (pipelines/cli.py), and Make
# targets of their own; `qeval stage <name>` runs any of them too.
STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in (
        StageSpec(
            name="quantize",
            command="quantize",
            make_target="quantize",
            result=Quantized,
            needs_baseline=False,
            judged=False,
        ),
        StageSpec(
            name="evaluate",
            command="evaluate",
            make_target="evaluate",
            result=Evaluated,
            needs_baseline=True,
            judged=True,
        ),
        StageSpec(
            name="bench",
            command="bench",
            make_target="bench",
            result=Benched,
            needs_baseline=True,
            judged=True,
        ),
        # random weights at the model's shape: what runs where the weights do not, never beside them
        StageSpec(
            name="shape",
            command="shape",
            make_target="shape",
            result=AtShape,
            needs_baseline=False,
            judged=True,
            needs_weights=False,
            full_run=False,
        ),
        StageSpec(
            name="size",
            result=Sized,
            command="size --log",
            make_target="size",
            needs_baseline=False,
            judged=True,
            needs_weights=False,
        ),
        StageSpec(
            name="serve",
            command="serve",
            make_target="serve",
            result=Served,
            needs_baseline=False,
            judged=True,
        ),
        # a precision's layer groups ranked for the mixed-precision search, which runs it after the builds' stages
        StageSpec(
            name="sensitivity",
            command="sensitivity",
            make_target="sensitivity",
            result=Ranked,
            needs_baseline=False,
            judged=False,
            full_run=False,
        ),
    )
}
JUDGED = tuple(name for name, s in STAGES.items() if s.judged)
FULL_RUN = tuple(name for name, s in STAGES.items() if s.full_run)
"""What `qeval run` runs for a card whose weights are reachable, in order."""
SPEED_HALF = tuple(name for name, s in STAGES.items() if not s.needs_weights)
"""What it runs for a card whose weights are not: the stages that need none."""


def get_stage(name: str) -> StageSpec:
    """The stage named `name`; a ValueError listing the stages otherwise."""
    return lookup(STAGES, name, "stage")


def spec_of(kind: type[StageResult]) -> StageSpec:
    """The stage whose result is `kind`."""
    return STAGES[kind.STAGE]


def stale_stage(card: ModelCard, precision: str, current: str | None) -> str | None:
    """The first finished stage of the build whose files are not as it left them, or that measured other weights
    than `current` (the digest that identifies its checkpoint now; None: not known here), as one line naming the
    command that runs it again; None where every stage holds."""
    for spec in STAGES.values():
        done = finished(card.name, precision, spec.result)
        if done is None:
            continue
        if lost := not_as_left(stage_dir(card.name, precision, spec.name), done):
            why = f"{lost} since it finished"
        elif current is not None and done.inputs.get("checkpoint", current) != current:
            why = "it measured other weights than the checkpoint holds now (built again since)"
        else:
            continue
        build = f"--model {card.name} --precision {precision}"
        return f"{card.name}@{precision} {spec.name}: {why}; rerun: qeval {spec.command} {build}"
    return None


def require(card: ModelCard, precision: str, kind: type[R], who: str) -> R:
    """The build's finished result of this kind; a QevalError naming the command that makes it otherwise."""
    done = finished(card.name, precision, kind)
    if done is None:
        raise QevalError(
            f"{who}: {card.name}@{precision} has no finished {kind.STAGE} stage; run: "
            f"qeval {spec_of(kind).command} --model {card.name} --precision {precision}"
        )
    return done.result
