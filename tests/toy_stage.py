"""A stage as a newcomer adds one, for tests/test_new_stage.py: its module (the function below) and its result
type, which declares what it logs to MLflow. The test registers it with one entry."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pipelines.core.card.cards import ModelCard
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import model_config, resolve_weights
from pipelines.core.store.manifests import StageRecord
from pipelines.core.store.results import StageResult
from pipelines.core.store.results.logs import Logs

WORKED: list[str] = []
"""The builds its work ran for, in order (a cached run adds nothing)."""


class Counted(StageResult):
    """The base model's decoder layers, counted from its config."""

    STAGE: ClassVar[str] = "toy"
    LOGS: ClassVar[Logs] = Logs(
        metrics={"toy/layers": lambda r: r.layers},
        params={"toy.source": lambda r: r.source},
    )

    layers: int
    source: str

    def headline(self) -> str:
        return f"{self.layers} layers"


def toy(card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False) -> StageRecord[Counted]:
    """Count the layers of the card's base model, once per build and inputs."""
    base = resolve_weights(card)

    def work(folder: Path) -> Counted:
        WORKED.append(precision)
        layers = int(model_config(base)["num_hidden_layers"])
        (folder / "layers.txt").write_text(f"{layers}\n")
        return Counted(layers=layers, source=card.name)

    return run_stage(tracker, precision, Counted, {"model": card.name, "base": base}, work, force=force)
