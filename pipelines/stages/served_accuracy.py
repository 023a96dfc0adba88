"""The serve stage's second half: the build's accuracy as its server scores it, beside the offline scores.

lm-eval's completions backend runs the card's tasks (or `server.served_tasks`, the first
`server.served_limit` documents of each) against the server, sending the offline evaluation's exact token
windows; each task's judging metric is then compared with the offline score of the same documents
(served - offline, paired interval; eval/quality/paired.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import eval.quality.accuracy as accuracy
from eval.quality.paired import Scored, agreement, paired
from pipelines.core.card.cards import ModelCard
from pipelines.core.framework.weights import model_positions, offline_env
from pipelines.core.store.layout import STAGE_LOG, stage_dir
from pipelines.core.store.manifests import Manifest, finished
from pipelines.core.store.results import Evaluated, ServedAccuracy, ServedVsOffline
from pipelines.core.system.child import run_child
from pipelines.core.system.errors import QevalError

log = logging.getLogger(__name__)
SERVED_DIR = "served_accuracy"
SERVED_BATCH = 32
"""Prompts per completions request: the server batches them, in fewer round trips (docs/toolchain.md)."""


def not_run(engine: str) -> str:
    return (
        f"served accuracy (server.served_accuracy in the card): it needs vLLM's prompt log-probabilities, "
        f"and {engine} served"
    )


def plan(
    card: ModelCard, precision: str, checkpoint: str, engine: str
) -> tuple[accuracy.AccuracyConfig | None, Manifest[Evaluated] | None]:
    """The lm-eval run against the server (the offline evaluation's settings, through the completions
    API), and the offline evaluation it is compared with; (None, None) where the card does not ask."""
    if not card.server.served_accuracy:
        return None, None
    if engine != "vllm":
        log.warning("%s@%s: %s", card.name, precision, not_run(engine))
        return None, None
    offline = finished(card.name, precision, Evaluated)
    if offline is None:
        raise QevalError(
            f"{card.name}@{precision}: served accuracy is compared with the offline evaluation; "
            f"run it first: qeval evaluate --model {card.name} --precision {precision}"
        )
    base = offline.result.config
    limits = [n for n in (base.limit, card.server.served_limit) if n]
    tasks = [t for t in card.server.served_tasks or base.tasks if t not in offline.result.accuracy.not_scored]
    if not tasks:
        log.warning("%s@%s: served accuracy not run: no task it names was scored offline", card.name, precision)
        return None, None
    scored = base.model_copy(
        update={
            "tasks": tasks,
            "stop": None,  # a cross-check of the engine on what was scored offline
            "limit": min(limits) if limits else None,
            "batch_size": SERVED_BATCH,
            "backend": "local-completions",
            "kv_cache_dtype": "auto",  # the server keeps the KV cache, in the dtype it was started with
            "served_model": checkpoint,
            "max_length": base.max_length or model_positions(checkpoint),  # the offline windows, exactly
        }
    )
    return scored, offline


def score(card: ModelCard, scored: accuracy.AccuracyConfig, base_url: str, out: Path) -> ServedAccuracy:
    """Run lm-eval against the server at `base_url`, in a child process."""
    cfg = scored.model_copy(update={"base_url": base_url})
    result = run_child(accuracy.evaluate_accuracy, cfg, out / SERVED_DIR, out / STAGE_LOG, offline_env(card))
    return ServedAccuracy(config=scored, accuracy=result, vs_offline={})


def against_offline(
    card: ModelCard, precision: str, served: ServedAccuracy, offline: Manifest[Evaluated], out: Path
) -> ServedAccuracy:
    """Each served task's judging metric against the offline score of the same documents."""
    offline_side = Scored(stage_dir(card.name, precision, Evaluated.STAGE), offline.result.accuracy)
    served_side = Scored(out / SERVED_DIR, served.accuracy)
    gate = card.gate
    vs = {}
    for task in served.config.tasks:
        try:
            c = paired(
                task,
                offline_side,
                served_side,
                threshold=gate.threshold(task),
                bootstrap=gate.bootstrap,
                metric=gate.task_metric.get(task),
                subset=True,
            )
            departs = agreement(task, offline_side, served_side, subset=True, seed=gate.bootstrap_seed)
        except (FileNotFoundError, KeyError, ValueError) as e:
            raise QevalError(f"{card.name}@{precision} served accuracy of {task}: {e}; rerun with --force") from None
        same = departs.identical if departs else None
        vs[task] = ServedVsOffline(
            metric=c.metric,
            n=c.n,
            offline=c.baseline,
            served=c.build,
            difference=c.difference,
            confidence=gate.confidence,
            identical=same,
        )
        est, lo, hi = c.difference
        log.info(
            "%s@%s %s %s served %.5g vs offline %.5g: %+.3g [%+.3g, %+.3g]%s",
            card.name,
            precision,
            task,
            c.metric,
            c.build,
            c.baseline,
            est,
            lo,
            hi,
            " DIFFERS" if vs[task].differs else "",
        )
    return served.model_copy(update={"vs_offline": vs})
