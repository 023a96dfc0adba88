"""How a stage's typed result reaches its build's MLflow run, declared beside the result type (its `LOGS`).

A declaration is tables, no MLflow: metric name -> how the result gives the figure, param name -> how it gives the
value, a config's fields -> their params, the points of its series with a figure of each, and for names made from
the result's own keys (a task, a GPU, a scenario) a function with the names as docs/mlflow.md writes them.
pipelines/tracking/mapping.py turns a result into what its run logs by reading the declaration, and
pipelines/tracking/tables.py lists every name from the stage registry's result types, so that a new stage is its
module, its result type (with its `LOGS`) and one registry entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Getter = Callable[[Any], Any]


@dataclass
class Logged:
    """What one stage writes to its build's run."""

    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Metrics over a step (batch size, concurrency): name -> [(step, value), ...]."""
    params: dict[str, str] = field(default_factory=dict)
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def update(self, other: Logged) -> Logged:
        """Both, `other`'s winning where a name is in each."""
        return Logged(
            self.metrics | other.metrics,
            self.series | other.series,
            self.params | other.params,
            self.datasets | other.datasets,
            self.tags | other.tags,
        )


@dataclass(frozen=True)
class Settings:
    """A config's fields as params: `config` gives the config from the result (None: it has none), `params` maps
    its fields to param names, `unlogged` names each field that is not a setting and why
    (tests/test_tracking.py: every field is one or the other)."""

    kind: type
    config: Getter
    params: Mapping[str, str]
    unlogged: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Logs:
    """What a result type logs to its build's run."""

    metrics: Mapping[str, Getter] = field(default_factory=dict)
    params: Mapping[str, Getter] = field(default_factory=dict)
    """Derived from the result; a param of a setting's name is overridden."""
    settings: tuple[Settings, ...] = ()
    points: Getter | None = None
    """result -> [(step, point)]: the steps (batch size, concurrency) its `series` are figures of."""
    series: Mapping[str, Getter] = field(default_factory=dict)
    more: Callable[[Any], Logged] | None = None
    """Names made from the result's own keys (a task, a GPU, a scenario)."""
    templates: Mapping[str, Iterable[str]] = field(default_factory=dict)
    """`more`'s names as docs/mlflow.md lists them, by kind (metrics, series, params): `eval/<task>/<metric>`."""
    not_run: Getter | None = None
    """What the card asked of the stage that it could not do, and why (the run's tag `qeval.stage.<stage>.not_run`)."""

    def names(self, kind: str) -> list[str]:
        """Every name of one kind (metrics, series, params) the result type may log."""
        own = {
            "metrics": list(self.metrics),
            "series": list(self.series),
            "params": [*(p for s in self.settings for p in s.params.values()), *self.params],
        }
        return [*own.get(kind, []), *self.templates.get(kind, ())]


def templated(name: str) -> str:
    """A name made from keys as docs/mlflow.md writes it: `eval/{task}` -> `eval/<task>`."""
    return name.replace("{", "<").replace("}", ">")


def text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def numbers(table: Mapping[str, Getter], obj: Any) -> dict[str, float]:
    """The table's figures of `obj` that are numbers (a None or a text is not logged)."""
    values = {name: get(obj) for name, get in table.items()}
    return {k: float(v) for k, v in values.items() if v is not None and not isinstance(v, str)}


def texts(table: Mapping[str, Getter], obj: Any) -> dict[str, str]:
    """The table's values of `obj` as params (a None is not logged)."""
    values = {name: get(obj) for name, get in table.items()}
    return {k: text(v) for k, v in values.items() if v is not None}


def settings(config: Any, table: Mapping[str, str]) -> dict[str, str]:
    """A config's fields as their params (nothing where there is no config)."""
    return {param: text(getattr(config, name)) for name, param in table.items()} if config is not None else {}


def finite(values: dict[str, float]) -> dict[str, float]:
    """What MLflow can hold: an infinite or undefined figure is not logged."""
    return {k: v for k, v in values.items() if math.isfinite(v)}
