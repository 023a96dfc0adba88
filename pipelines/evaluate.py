"""The evaluate stage: lm-eval accuracy of one build, logged as `eval/<task>/<metric>`."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

import eval.accuracy as accuracy
from eval.compare import recoveries
from pipelines.cards import ModelCard, offline_env
from pipelines.child import run_child
from pipelines.errors import QevalError
from pipelines.paths import resolve_repo_path
from pipelines.quantize import checkpoint_for
from pipelines.stages import StageOutput, StageRecord, file_digest, read_manifest, run_stage, stage_dir
from pipelines.tracking import Tracker, lm_eval_metrics

STAGE = "evaluate"
log = logging.getLogger(__name__)


def evaluate(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, limit: int | None = None
) -> StageRecord:
    """Run the card's lm-eval tasks on one build and log them to its MLflow run."""
    checkpoint, checkpoint_id = checkpoint_for(card, precision)
    acc = card.accuracy
    include = resolve_repo_path(acc.include_path) if acc.include_path else None
    if include is not None and not include.is_dir():
        raise QevalError(f"model '{card.name}': accuracy.include_path {include} is not a folder")
    cfg = accuracy.AccuracyConfig(
        checkpoint=checkpoint,
        tasks=acc.tasks,
        include_path=str(include) if include else None,
        num_fewshot=acc.num_fewshot,
        limit=limit or acc.limit,
        batch_size=acc.batch_size,
        seed=acc.seed,
        trust_remote_code=card.source.trust_remote_code,
    )
    inputs = {
        "checkpoint": checkpoint_id,
        "config": cfg.model_dump(exclude={"checkpoint", "include_path"}),
        "task_files": file_digest(_task_files(include)) if include else None,
    }
    baseline = _baseline_result(card, precision, inputs)
    inputs["baseline"] = baseline["inputs_digest"] if baseline else None

    def work(out: Path) -> StageOutput:
        result = run_child(
            "eval.accuracy:evaluate_accuracy", cfg, out, accuracy.AccuracyResult, out / "lm_eval.log", offline_env(card)
        )
        metrics = lm_eval_metrics(result.results)
        if baseline:
            base = baseline["summary"]
            metrics |= lm_eval_metrics(
                recoveries(result.results, base["results"], base["higher_is_better"]), "recovery"
            )
        for task, chance in result.chance.items():
            log.info("%s@%s %s: %s (chance %s)", card.name, precision, task, _headline(result.results[task]), chance)
        return StageOutput(
            metrics=metrics,
            datasets=result.datasets,
            params={
                "eval.tasks": ",".join(cfg.tasks),
                "eval.num_fewshot": str(cfg.num_fewshot),
                "eval.limit": str(cfg.limit),
                "eval.batch_size": str(cfg.batch_size),
                "eval.dtype": cfg.dtype,
                "eval.task_data_sha256": inputs["task_files"] or "hub",
            },
            summary={
                "results": result.results,
                "higher_is_better": result.higher_is_better,
                "chance": result.chance,
                "backend": result.backend,
                "n_samples": result.n_samples,
                "seconds": result.seconds,
                "peak_rss_mb": result.peak_rss_mb,
                "lm_eval_version": result.lm_eval_version,
            },
        )

    return run_stage(tracker, precision, STAGE, inputs, _code(), work, force=force)


def _baseline_result(card: ModelCard, precision: str, inputs: dict) -> dict | None:
    """The baseline's finished evaluate manifest, for recovery; None for the baseline itself.

    The baseline must have been evaluated with the same settings (tasks, limit, few-shot, ...):
    recovery of one subset of documents against another would be meaningless.
    """
    if precision == card.gate.baseline:
        return None
    done = read_manifest(stage_dir(card.name, card.gate.baseline, STAGE))
    fix = f"qeval evaluate --model {card.name} --precision {card.gate.baseline}"
    if not done or done.get("status") != "done":
        raise QevalError(f"{card.name}@{precision}: evaluate the baseline first, for recovery: {fix}")
    same = {k: done["inputs"].get(k) for k in ("config", "task_files")} == {
        k: inputs[k] for k in ("config", "task_files")
    }
    if not same:
        limit = inputs["config"]["limit"]
        raise QevalError(
            f"{card.name}@{precision}: the baseline was evaluated with other settings (tasks, limit or task "
            f"data); evaluate both the same way: {fix}{f' --limit {limit}' if limit else ''}"
        )
    return done


def _headline(values: dict) -> str:
    return ", ".join(
        f"{k.split(',')[0]}={v:.4g}" for k, v in values.items() if isinstance(v, float) and "stderr" not in k
    )


class _TaskYamlLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs, whose `!function` tags name Python code we do not need here."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _task_files(include: Path) -> list[Path]:
    """The local task YAMLs and the data files they name, so that editing either reruns the stage."""
    files = sorted(include.glob("*.yaml"))
    for f in list(files):
        spec = yaml.load(f.read_text(), Loader=_TaskYamlLoader) or {}
        data_files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
        for value in data_files.values() if isinstance(data_files, dict) else [data_files]:
            if isinstance(value, str) and resolve_repo_path(value).is_file():
                files.append(resolve_repo_path(value))
    return files


def _code() -> list[Path]:
    return [Path(accuracy.__file__), Path(__file__), Path(run_child.__code__.co_filename)]
