"""The stage registry: every fact about a stage in one place, in the order `qeval run` runs them.

A stage's name is its folder under artifacts/<model>/<precision>/, its MLflow tag `qeval.stage.<name>`
and the word `qeval run --skip` takes. The run order (pipelines/run.py), the Ray fan-out
(pipelines/fanout.py), the read-back from the store (pipelines/tracking/readback.py), the stage framework's
cache key (pipelines/core/runner.py: the code of `function`'s module and what it imports) and the error
that names the command to run all read it from here. Functions are named by import path, so that this
module imports no stage.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pipelines.core.errors import QevalError
from pipelines.core.manifests import finished
from pipelines.core.results import AtShape, Benched, Evaluated, Quantized, Served, Sized, StageResult
from quant.registry import lookup

if TYPE_CHECKING:
    from pipelines.core.cards import ModelCard

R = TypeVar("R", bound=StageResult)


@dataclass(frozen=True)
class StageSpec:
    """One stage of a build."""

    name: str
    result: type[StageResult]
    function: str
    """`module:function` that runs it: (card, precision, tracker, *, force, ...) -> StageRecord."""
    command: str
    """The qeval command that runs it for one build (`qeval <command> --model M --precision P`)."""
    make_target: str
    needs_baseline: bool
    """A quantized build's run of it reads the baseline's (recovery, speed-up): the baseline's comes first."""
    judged: bool
    """The gate and the report read it (and read it back from the tracking store where this machine lacks it)."""
    needs_weights: bool = True
    """It reads the build's weights; the speed half of a card whose weights are not reachable runs the others."""
    full_run: bool = True
    """`qeval run` runs it for a card whose weights are reachable."""

    @property
    def module(self) -> str:
        return self.function.partition(":")[0]

    def load(self) -> Callable:
        """The stage's function (its module is imported now, not when the registry is)."""
        module, _, name = self.function.partition(":")
        return getattr(importlib.import_module(module), name)


STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in (
        StageSpec("quantize", Quantized, "pipelines.stages.quantize:quantize", "quantize", "quantize", False, False),
        StageSpec("evaluate", Evaluated, "pipelines.stages.evaluate:evaluate", "evaluate", "evaluate", True, True),
        StageSpec("bench", Benched, "pipelines.stages.bench:bench", "bench", "bench", True, True),
        # random weights at the model's shape: what runs where the weights do not, never beside them
        StageSpec(
            "shape",
            AtShape,
            "pipelines.stages.shape:shape",
            "shape",
            "shape",
            False,
            True,
            needs_weights=False,
            full_run=False,
        ),
        StageSpec("size", Sized, "pipelines.stages.size:size", "size --log", "size", False, True, needs_weights=False),
        StageSpec("serve", Served, "pipelines.stages.serve:serve", "serve", "serve", False, True),
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


def require(card: ModelCard, precision: str, kind: type[R], who: str) -> R:
    """The build's finished result of this kind; a QevalError naming the command that makes it otherwise."""
    done = finished(card.name, precision, kind)
    if done is None:
        raise QevalError(
            f"{who}: {card.name}@{precision} has no finished {kind.STAGE} stage; run: "
            f"qeval {spec_of(kind).command} --model {card.name} --precision {precision}"
        )
    return done.result
