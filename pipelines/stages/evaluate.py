"""The evaluate stage: lm-eval accuracy of one build, and its recovery against the baseline's.

Every build of a card is scored by one engine of record, the card's `accuracy.engine`: on `auto`, vLLM on a
GPU (lm-eval's vllm backend, run by the engine's own Python, .venv-vllm, where vLLM lives) and transformers on
a CPU, where it scores faster than vLLM's CPU build; the engine is each evaluation's `backend` setting, so the
baseline and its builds are compared only when one engine scored them all.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import eval.quality.accuracy as accuracy
from eval.devices.sizing import KV_DTYPE_BYTES
from eval.quality.compare import recoveries
from eval.quality.kvcache import rounds_query
from eval.quality.lm_tasks import task_files
from eval.quality.rounds import Rounds
from eval.quality.stopping import StopScoring, TaskRule
from pipelines.core.card.cards import ModelCard
from pipelines.core.card.search import judging
from pipelines.core.framework.demands import check_tasks
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import checkpoint_for, model_config, model_positions, offline_env
from pipelines.core.store.layout import STAGE_LOG, stage_dir
from pipelines.core.store.manifests import Manifest, StageRecord, finished
from pipelines.core.store.results import Evaluated, evaluation_settings
from pipelines.core.system.child import ChildFailed, run_child
from pipelines.core.system.device import compute_device
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import file_digest
from pipelines.core.system.nvidia import memory_back_after
from pipelines.core.system.paths import REPO_ROOT, resolve_repo_path
from pipelines.stages.engines import Vllm, cpu_kv_space_gb, find_vllm, gpu_memory_plan
from quant.execution import compute_dtype
from quant.precisions import kv_cache_dtype

log = logging.getLogger(__name__)


def evaluate(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, limit: int | None = None
) -> StageRecord[Evaluated]:
    """Run the card's lm-eval tasks on one build and log them to its MLflow run."""
    check_tasks(card)  # every task YAML readable and every task defined, before a model loads
    checkpoint, checkpoint_id = checkpoint_for(card, precision)
    cfg = accuracy_config(card, precision, checkpoint, limit)
    include = Path(cfg.include_path) if cfg.include_path else None
    task_data = file_digest(task_files(include, REPO_ROOT)) if include else None
    baseline = _baseline(card, precision, cfg, task_data)
    if baseline is not None and card.gate.stop_scoring != "never":
        cfg = cfg.model_copy(update={"stop": stop_scoring(card, baseline)})
    vllm = _engine_python(card, cfg)
    inputs = {
        "checkpoint": checkpoint_id,
        "engine_version": f"{vllm.distribution} {vllm.version}" if vllm else None,
        "settings": evaluation_settings(cfg, task_data),
        "kv_cache_dtype": cfg.kv_cache_dtype,  # apart from the settings, which a KV-cache variant shares
        "baseline": baseline.inputs_digest if baseline else None,
        "stop": cfg.stop.key() if cfg.stop else None,  # where scoring stops: the card's gate
    }

    def work(out: Path) -> Evaluated:
        return _evaluate(card, precision, cfg, task_data, baseline.result if baseline else None, out, vllm)

    return run_stage(tracker, precision, Evaluated, inputs, work, force=force)


def check_where_scored(card: ModelCard) -> None:
    """Every task of the card loaded by the Python that will score it where that is not this one (on a GPU the
    engine's, .venv-vllm): a package it lacks is said here, before any build is made, not at the baseline's
    evaluation after every build was quantized (RULER's wonderwords, once). Its documents are made where they
    are local, its code imported where its data set is the hub's (eval/quality/lm_tasks.py, check)."""
    check_tasks(card)
    checkpoint, _ = checkpoint_for(card, card.gate.baseline)
    cfg = accuracy_config(card, card.gate.baseline, checkpoint)
    vllm = _engine_python(card, cfg)
    if vllm is None:
        return  # transformers scores in this interpreter, which reads every task when it evaluates
    with tempfile.TemporaryDirectory(prefix="qeval-tasks-") as tmp:
        out = Path(tmp)
        try:
            loaded = run_child(accuracy.tasks_load, cfg, out, out / STAGE_LOG, offline_env(card), python=vllm.python)
        except ChildFailed as e:
            raise QevalError(
                f"model '{card.name}': the engine's Python ({vllm.python}), which scores every build here, cannot "
                f"load its tasks: {e}; install what it lacks there (make engine-eval installs lm-eval[ruler])"
            ) from None
    for task, what in loaded.checked.items():
        log.info("%s %s: loads in %s (%s)", card.name, task, loaded.python, what)


def accuracy_config(
    card: ModelCard, precision: str, checkpoint: str, limit: int | None = None
) -> accuracy.AccuracyConfig:
    """The lm-eval settings of one build here: the card's, the engine of record for this device, its context window."""
    acc, here = card.accuracy, compute_device()
    include = resolve_repo_path(acc.include_path) if acc.include_path else None
    if include is not None and not include.is_dir():
        raise QevalError(f"model '{card.name}': accuracy.include_path {include} is not a folder")
    backend = acc.engine if acc.engine != "auto" else ("vllm" if here.kind == "cuda" else "hf")
    kv = kv_cache_dtype(precision, card.server.kv_cache_dtype)
    config = model_config(checkpoint)
    window = card.context_window(model_positions(checkpoint))
    share, eager, batch = (0.9, False, acc.batch_size)
    if backend == "vllm":  # sized like the build's server: a small model eager, in a share of the GPU it needs
        share, eager = (
            gpu_memory_plan(config, KV_DTYPE_BYTES[kv], acc.batch_size, window or 2048, here.memory_bytes)
            if here.kind == "cuda"
            else (0.9, True)
        )
        share = min(share, SCORING_SHARE)
    elif here.kind == "cuda" and here.memory_bytes:
        batch = min(batch, _logits_batch(config, window, here.memory_bytes))
    return accuracy.AccuracyConfig(
        checkpoint=checkpoint,
        tasks=acc.tasks,
        include_path=str(include) if include else None,
        num_fewshot=acc.num_fewshot,
        limit=limit or acc.limit,
        batch_size=batch,
        seed=acc.seed,
        dtype=compute_dtype(here.device),
        trust_remote_code=card.source.trust_remote_code,
        backend=backend,
        tensor_parallel=card.server.tensor_parallel or 1,
        vllm_memory_share=share,
        vllm_eager=eager,
        max_length=window,
        max_seq_lengths=acc.max_seq_lengths,
        # the KV cache the build is served with: vLLM's own, or emulated on transformers as vLLM keeps it here
        kv_cache_dtype=kv,
        fp8_query=kv == "fp8" and backend == "hf" and rounds_query(here.capability),
        # builds that may stop are scored a task at a time, and so is their baseline: the same batches; and on
        # vLLM, so that one task's failure (its memory) leaves the others scored
        one_at_a_time=card.gate.stop_scoring != "never" or backend == "vllm",
        rounds=scoring_rounds(card),
    )


def scoring_rounds(card: ModelCard) -> Rounds | None:
    """Where builds may stop and are judged by confidence sequences, every build of the card, the baseline too, is
    scored in the gate's rounds (eval/quality/rounds.py): a build's task until its verdict is known."""
    gate = card.gate
    if gate.stop_scoring == "never" or gate.verdicts != "sequential":
        return None
    return Rounds(every=gate.look_every, seed=gate.bootstrap_seed, controls=gate.controls)


def stop_scoring(card: ModelCard, baseline: Manifest[Evaluated]) -> StopScoring:
    """The card's `gate.stop_scoring` as the evaluation applies it: each task's rule as the gate holds it."""
    gate = card.gate
    rules = {
        task: TaskRule(
            threshold=gate.threshold(task),
            metric=gate.task_metric.get(task),
            control=gate.controls.get(task),
            length_band=gate.max_length_change,
        )
        for task in card.accuracy.tasks
    }
    return StopScoring(
        when=gate.stop_scoring,
        rules=rules,
        bootstrap=judging(card),
        baseline=baseline.result.accuracy,
        baseline_folder=str(stage_dir(card.name, gate.baseline, Evaluated.STAGE)),
    )


SCORING_SHARE = 0.85
"""The most of a GPU vLLM takes to score: its memory profiling does not count the logits of prompt
log-probabilities, which every log-likelihood asks for (vllm-project/vllm#5067), so a tenth is not enough
room beside a 0.9 share."""
LOGITS_SHARE = 0.25
"""The share of a GPU a batch of the transformers engine's logits may take."""


def _logits_batch(config: dict, window: int | None, gpu_memory: int) -> int:
    """Documents per forward that keep transformers' logits of a full window within LOGITS_SHARE of the GPU: a
    16-bit [batch, window, vocabulary] tensor and its float32 log-softmax, 10 bytes an entry (lm-eval's hf
    backend scores a rolling window whole). The same for every build of a model: it is its shape's."""
    vocab = config.get("text_config", config).get("vocab_size") or 0
    per_document = 10 * (window or 0) * vocab
    return max(1, int(LOGITS_SHARE * gpu_memory // per_document)) if per_document else 1_000_000


def _engine_python(card: ModelCard, cfg: accuracy.AccuracyConfig) -> Vllm | None:
    """The Python that runs lm-eval's vllm backend (None for transformers, which runs in this environment)."""
    if cfg.backend != "vllm":
        return None
    found = find_vllm()
    if found is None or not found.lm_eval:
        what = "no vLLM is installed here" if found is None else f"{found.python} has vLLM but not lm-eval"
        raise QevalError(
            f"model '{card.name}': accuracy.engine is vllm (lm-eval's vllm backend) and {what}; make it "
            f"with `make engine` (.venv-vllm), or set accuracy.engine: hf"
        )
    return found


def _evaluate(
    card: ModelCard,
    precision: str,
    cfg: accuracy.AccuracyConfig,
    task_data: str | None,
    baseline: Evaluated | None,
    out: Path,
    vllm: Vllm | None,
) -> Evaluated:
    env = offline_env(card)
    if vllm is not None and compute_device().kind == "cpu":  # vLLM's CPU build sizes its cache from this
        length = cfg.max_length or model_positions(cfg.checkpoint) or 2048
        entry = KV_DTYPE_BYTES["auto"]  # the 16-bit entries of the widest KV cache a build evaluates with
        space = cpu_kv_space_gb(model_config(cfg.checkpoint), entry, length, card.server.cpu_kv_cache_gb)
        env = {**env, "VLLM_CPU_KVCACHE_SPACE": f"{space:g}"}
    on_gpu = vllm is not None and compute_device().kind == "cuda"  # the next build's vLLM starts once it is back
    with memory_back_after(f"vLLM's scoring of {card.name}@{precision}", on_gpu):
        python = vllm.python if vllm else None
        result = run_child(accuracy.evaluate_accuracy, cfg, out, out / STAGE_LOG, env, python=python)
    for task, why in result.not_scored.items():
        log.warning("%s@%s %s: not scored (%s)", card.name, precision, task, why)
    for task in cfg.tasks:
        if task in result.not_scored:
            continue
        shown = ", ".join(f"{m.id}={m.value:.4g}" for m in result.scores.get(task, []))
        log.info("%s@%s %s: %s (chance %s)", card.name, precision, task, shown, result.chance.get(task))
    recovery = None
    if baseline is not None:  # point recoveries where both scored the same documents (the gate pairs the rest)
        base = baseline.accuracy
        same = {t: v for t, v in result.values().items() if result.n_samples.get(t) == base.n_samples.get(t)}
        recovery = recoveries(same, base.values(), base.higher_is_better())
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
