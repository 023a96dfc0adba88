"""The mixed-precision search's record: artifacts/<model>/search.json (pipelines/search.py writes it, the report
reads it)."""

from __future__ import annotations

from pydantic import Field, ValidationError

from eval.quality.stats import Verdict
from pipelines.core.store.results import Record
from pipelines.core.store.results.ranked import Candidate
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import atomic_write
from pipelines.core.system.paths import artifacts_dir


class Tried(Record):
    """A build the search judged: a uniform one at the frontier's ends, or a mix it built and evaluated."""

    precision: str
    kept: int = Field(description="layer groups at the fallback (0: the uniform target; -1: a build off the frontier)")
    weight_bytes: float = Field(description="its checkpoint's weight files")
    predicted_kl: float | None = Field(description="the frontier's divergence for it, nats per token")
    verdict: Verdict = Field(description="the gate's quality verdict: its tasks, lengths and unscored tasks")
    worst_task: str | None = None
    worst: tuple[float, float, float] | None = Field(None, description="that task's recovery [interval]")
    reason: str = Field("", description="the rule that decided it")


class Searched(Record):
    """What the search found: the ranking's check, the frontier, what it tried, and the mix it chose."""

    model: str
    target: str
    fallback: str
    groups: int
    most_sensitive: list[str] = Field(description="the ranking's first groups, most sensitive first")
    top_half_kl: float
    bottom_half_kl: float
    frontier: list[Candidate] = Field(description="predicted, before any mix is built")
    first: int | None = Field(description="the groups kept by the first mix tried (the one predicted to pass)")
    uniform: list[Tried] = Field(description="the card's uniform builds, judged the same way")
    tried: list[Tried] = Field(description="the mixes built and evaluated, in the order tried")
    max_evaluations: int
    chosen: str | None = Field(description="the mix that passes with the fewest bytes (None: none found)")
    carried: str | None = Field(description="the mix the rest of the pipeline measures: chosen, else the last tried")
    why: str

    @property
    def answered(self) -> bool:
        """A mix passes, or the target passes as it is and needs none: what `qeval search` exits 0 on."""
        return self.chosen is not None or any(
            t.precision == self.target and t.verdict == Verdict.PASS for t in self.uniform
        )


def search_file(model: str):
    return artifacts_dir() / model / "search.json"


def write_search(found: Searched) -> None:
    path = search_file(found.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, found.model_dump_json(indent=2) + "\n")


def read_search(model: str) -> Searched | None:
    """The last search's record for `model`; None where none ran, QevalError where the file is not one."""
    path = search_file(model)
    if not path.exists():
        return None
    try:
        return Searched.model_validate_json(path.read_text())
    except ValidationError as e:
        raise QevalError(
            f"{path} is not a search record of this qeval ({e.error_count()} errors); rerun qeval search"
        ) from None


def current(card) -> Searched | None:
    """The last search's record for the card (pipelines/core/card/cards.py's ModelCard), where the card still
    searches the same target and fallback; None otherwise."""
    found = read_search(card.name) if card.search else None
    if found is None or (found.target, found.fallback) != (card.search.target, card.search.fallback):
        return None
    return found


def with_carried(card):
    """The card with the mix its current search carried on among its precisions: what `qeval run` gated, for the
    commands that read a card again (gate, report, a stage's own command)."""
    found = current(card)
    if found is None or found.carried is None or found.carried in card.precisions:
        return card
    return card.model_copy(update={"precisions": [*card.precisions, found.carried]})
