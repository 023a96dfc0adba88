"""The evaluate stage's result: lm-eval on a build's checkpoint, its recovery, and what it logs."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from eval.quality.accuracy import AccuracyConfig
from eval.quality.paired import PREFERRED_METRICS
from eval.quality.records import AccuracyResult
from pipelines.core.store.results.base import StageResult
from pipelines.core.store.results.logs import Getter, Logged, Logs, Settings, finite, templated

METRIC = "eval/{task}/{metric}"
STDERR = "eval/{task}/{name}_stderr{filter}"
DOCUMENTS = "eval/{task}/documents"  # scored: a task in rounds (eval/quality/rounds.py) stops when its verdict is known
RECOVERY = "recovery/{task}/{metric}"
PARAMS: dict[str, Getter] = {
    "eval.backend": lambda e: e.accuracy.backend,
    "eval.task_data_sha256": lambda e: e.task_data_sha256 or "hub",
    "eval.stop_scoring": lambda e: e.config.stop.when if e.config.stop else "never",
    "eval.not_scored": lambda e: ", ".join(e.accuracy.not_scored) or "none",
    "eval.stopped": lambda e: e.accuracy.stopped() or "none",
}
SETTINGS = Settings(
    AccuracyConfig,
    lambda e: e.config,
    {
        name: f"eval.{name}"
        for name in (
            "tasks",
            "num_fewshot",
            "limit",
            "batch_size",
            "seed",
            "device",
            "dtype",
            "softmax_dtype",
            "kv_cache_dtype",
            "fp8_query",
            "bootstrap_iters",
            "trust_remote_code",
            "backend",
            "tensor_parallel",
            "vllm_memory_share",
            "vllm_eager",
            "max_length",
            "max_seq_lengths",
            "one_at_a_time",
            "rounds",
        )
    },
    {
        "checkpoint": "a path",
        "include_path": "a path; eval.task_data_sha256 identifies it",
        "base_url": "a loopback port of the moment",
        "served_model": "the checkpoint's path, as the server names it",
        "stop": "the card's gate (its rules) and the baseline's evaluation: param eval.stop_scoring says when",
    },
)


def _per_task(result: Evaluated) -> Logged:
    """Each task's scores (with their standard errors), its recovery against the baseline's and the documents it
    scored; lm-eval's data sets."""
    metrics = {}
    for task, scores in result.accuracy.scores.items():
        for m in scores:
            metrics[METRIC.format(task=task, metric=m.id)] = m.value
            if m.stderr is not None:
                suffix = "" if m.filter == "none" else f"/{m.filter}"
                metrics[STDERR.format(task=task, name=m.name, filter=suffix)] = m.stderr
    for task, values in (result.recovery or {}).items():
        metrics |= {RECOVERY.format(task=task, metric=k): v for k, v in values.items()}
    metrics |= {DOCUMENTS.format(task=task): n for task, n in result.accuracy.n_samples.items()}
    return Logged(finite(metrics), datasets=result.accuracy.datasets)


class Evaluated(StageResult):
    """lm-eval on a build's checkpoint, and its recovery against the baseline's."""

    STAGE: ClassVar[str] = "evaluate"
    LOGS: ClassVar[Logs] = Logs(
        params=PARAMS,
        settings=(SETTINGS,),
        more=_per_task,
        templates={"metrics": [*map(templated, (METRIC, DOCUMENTS, RECOVERY)), "eval/<task>/<metric>_stderr"]},
    )

    config: AccuracyConfig
    accuracy: AccuracyResult
    task_data_sha256: str | None = Field(description="local task YAMLs and data files (None: hub tasks)")
    recovery: dict[str, dict[str, float]] | None = Field(
        None, description="task -> metric id -> score against the baseline's (None: this is the baseline)"
    )

    @property
    def settings(self) -> dict[str, Any]:
        """What must match for two evaluations to be compared document by document."""
        return evaluation_settings(self.config, self.task_data_sha256)

    def headline(self) -> str:
        shown = []
        for task in self.config.tasks:
            scores = self.accuracy.scores.get(task) or []
            m = next((m for name in PREFERRED_METRICS for m in scores if m.name == name), scores[0] if scores else None)
            if m is not None:
                shown.append(
                    f"{task} {m.id} {m.value:.4g}" + (f" ({r:.4f})" if (r := self._recovery(task, m.id)) else "")
                )
        return ", ".join(shown)

    def _recovery(self, task: str, metric: str) -> float | None:
        return (self.recovery or {}).get(task, {}).get(metric)


def evaluation_settings(config: AccuracyConfig, task_data_sha256: str | None) -> dict[str, Any]:
    """An evaluation's settings and task data, what two evaluations compared document by document share: the
    checkpoint aside (paths: their digests stand in), the KV cache's dtype and how it is emulated, which a
    KV-cache variant changes against its own precision's evaluation and the baseline's, and where a build's
    scoring stops (the baseline has no stop rule)."""
    settings = config.model_dump(
        mode="json", exclude={"checkpoint", "include_path", "kv_cache_dtype", "fp8_query", "stop"}
    )
    return {**settings, "task_data_sha256": task_data_sha256}
