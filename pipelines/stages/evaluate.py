"""The evaluate stage: lm-eval accuracy of one build, and its recovery against the baseline's."""

from __future__ import annotations

import logging
from pathlib import Path

import eval.accuracy as accuracy
from eval.compare import recoveries
from pipelines.core.cards import ModelCard
from pipelines.core.child import run_child
from pipelines.core.code import environment
from pipelines.core.demands import check_tasks
from pipelines.core.errors import QevalError
from pipelines.core.files import file_digest
from pipelines.core.layout import STAGE_LOG
from pipelines.core.manifests import Manifest, StageRecord, finished
from pipelines.core.paths import REPO_ROOT, resolve_repo_path
from pipelines.core.results import Evaluated, evaluation_settings
from pipelines.core.runner import run_stage
from pipelines.core.tracker import Tracker
from pipelines.core.weights import checkpoint_for, offline_env
from quant.execution import Device, compute_dtype
from quant.precisions import kv_cache_dtype

log = logging.getLogger(__name__)


def evaluate(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, limit: int | None = None
) -> StageRecord[Evaluated]:
    """Run the card's lm-eval tasks on one build and log them to its MLflow run."""
    check_tasks(card)  # every task YAML readable and every task defined, before a model loads
    checkpoint, checkpoint_id = checkpoint_for(card, precision)
    cfg = _config(card, precision, checkpoint, limit)
    include = Path(cfg.include_path) if cfg.include_path else None
    task_data = file_digest(accuracy.task_files(include, REPO_ROOT)) if include else None
    baseline = _baseline(card, precision, cfg, task_data)
    inputs = {
        "checkpoint": checkpoint_id,
        "settings": evaluation_settings(cfg, task_data),
        "kv_cache_dtype": cfg.kv_cache_dtype,  # apart from the settings, which a KV-cache variant shares
        "baseline": baseline.inputs_digest if baseline else None,
    }

    def work(out: Path) -> Evaluated:
        return _evaluate(card, precision, cfg, task_data, baseline.result if baseline else None, out)

    return run_stage(tracker, precision, Evaluated, inputs, work, force=force)


def _config(card: ModelCard, precision: str, checkpoint: str, limit: int | None) -> accuracy.AccuracyConfig:
    acc = card.accuracy
    include = resolve_repo_path(acc.include_path) if acc.include_path else None
    if include is not None and not include.is_dir():
        raise QevalError(f"model '{card.name}': accuracy.include_path {include} is not a folder")
    return accuracy.AccuracyConfig(
        checkpoint=checkpoint,
        tasks=acc.tasks,
        include_path=str(include) if include else None,
        num_fewshot=acc.num_fewshot,
        limit=limit or acc.limit,
        batch_size=acc.batch_size,
        seed=acc.seed,
        dtype=compute_dtype(Device(environment()["device"])),
        trust_remote_code=card.source.trust_remote_code,
        tensor_parallel=card.server.tensor_parallel or 1,  # lm-eval's vLLM backend, where it runs (a GPU)
        # the KV cache the build is served with: vLLM's own on a GPU, emulated by the hf backend elsewhere
        kv_cache_dtype=kv_cache_dtype(precision, card.server.kv_cache_dtype),
    )


def _evaluate(
    card: ModelCard,
    precision: str,
    cfg: accuracy.AccuracyConfig,
    task_data: str | None,
    baseline: Evaluated | None,
    out: Path,
) -> Evaluated:
    result = run_child(accuracy.evaluate_accuracy, cfg, out, out / STAGE_LOG, offline_env(card))
    for task in cfg.tasks:
        shown = ", ".join(f"{m.id}={m.value:.4g}" for m in result.scores.get(task, []))
        log.info("%s@%s %s: %s (chance %s)", card.name, precision, task, shown, result.chance.get(task))
    recovery = None
    if baseline is not None:
        base = baseline.accuracy
        recovery = recoveries(result.values(), base.values(), base.higher_is_better())
    return Evaluated(config=cfg, accuracy=result, task_data_sha256=task_data, recovery=recovery)


def _baseline(
    card: ModelCard, precision: str, cfg: accuracy.AccuracyConfig, task_data: str | None
) -> Manifest[Evaluated] | None:
    """The baseline's finished evaluation, for recovery; None for the baseline itself.

    The baseline must have been evaluated with the same settings (tasks, limit, few-shot, ...):
    recovery of one subset of documents against another would be meaningless.
    """
    if precision == card.gate.baseline:
        return None
    done = finished(card.name, card.gate.baseline, Evaluated)
    fix = f"qeval evaluate --model {card.name} --precision {card.gate.baseline}"
    if done is None:
        raise QevalError(f"{card.name}@{precision}: evaluate the baseline first, for recovery: {fix}")
    if done.result.settings != evaluation_settings(cfg, task_data):
        raise QevalError(
            f"{card.name}@{precision}: the baseline was evaluated with other settings (tasks, limit or task "
            f"data); evaluate both the same way: {fix}{f' --limit {cfg.limit}' if cfg.limit else ''}"
        )
    return done
