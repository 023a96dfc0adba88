"""What every stage's typed result is: a record, with its stage's name, its headline and how it reaches MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from pipelines.core.store.results.logs import Logs


class Record(BaseModel):
    # a recovery can be infinite (x / 0) and a bootstrap bound NaN; JSON has neither, so write them as
    # JSON5's Infinity and NaN, which pydantic and Python's json read back
    model_config = ConfigDict(ser_json_inf_nan="constants")


class StageResult(Record):
    """A stage's typed result, stored in its manifest."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    STAGE: ClassVar[str]
    """The stage's name (pipelines/core/framework/registry.py): its folder, its MLflow tag, the word
    `qeval run --skip` takes."""
    KEPT_LOCALLY: ClassVar[tuple[str, ...]] = ()
    """Entries of the stage's folder logged only to a store on another machine: in a store on this machine's
    disk they would be a second copy of what qeval keeps beside it."""
    CHECKS_ITSELF: ClassVar[tuple[str, ...]] = ()  # entries its result checks (`altered`); the manifest the rest
    LOGS: ClassVar[Logs]
    """What it logs to its build's MLflow run (logs.py); pipelines/tracking/ reads it."""

    def headline(self) -> str:
        """One line for people: the stage's main figures."""
        raise NotImplementedError

    def altered(self, folder: Path) -> str | None:
        """What in the finished stage's `folder` is not as the stage left it (None: nothing, or not kept)."""
        return None
