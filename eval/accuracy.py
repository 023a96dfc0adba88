"""Accuracy of one build with lm-evaluation-harness: the only module that imports lm_eval or reads its formats.

evaluate_accuracy() writes lm_eval_results.json (lm-eval's own result document, samples removed) and
samples_<task>.jsonl (per-document records, for paired statistics) to its output folder, and returns
the scores normalised: one Metric per (task, metric, filter), `metric,filter` keys and "N/A" stderrs
resolved here. document_metrics() and documents() read the per-document records back, pooling a
group's subtasks; task_files() lists a local task folder's YAMLs and the data files they name. The
pipeline runs evaluate_accuracy() in a fresh process per build (pipelines/core/child.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eval.kvcache import fp8_kv_attention
from eval.qdq_bounds import clamp_with_number_bounds
from quant.registry import suggest


class AccuracyConfig(BaseModel):
    """What to evaluate and how; identical for every build of a model except `checkpoint`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(description="local folder of the saved build (HF format)")
    tasks: list[str] = Field(min_length=1, description="lm-eval task names")
    include_path: str | None = Field(None, description="folder of local task YAMLs")
    num_fewshot: int = Field(ge=0, description="few-shot examples per prompt")
    limit: int | None = Field(None, gt=0, description="documents per task (None: all)")
    batch_size: int = Field(gt=0)
    seed: int = Field(description="seed for python, numpy, torch and few-shot sampling")
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
        "before attention reads them (eval/kvcache.py)",
    )
    bootstrap_iters: int = Field(1000, ge=0, description="lm-eval's bootstrap resamples for metric stderrs")
    trust_remote_code: bool = False
    backend: Literal["auto", "hf", "vllm", "local-completions"] = Field(
        "auto", description="auto: vllm where installed and on a GPU, else hf; local-completions: a server's API"
    )
    tensor_parallel: int = Field(1, gt=0, description="vllm backend: GPUs the model is split over")
    base_url: str | None = Field(None, description="local-completions: the server's base URL (127.0.0.1)")
    served_model: str | None = Field(None, description="local-completions: the name the server serves it under")
    max_length: int | None = Field(
        None,
        gt=0,
        description="local-completions: the offline backend's context (the model's positions), "
        "so that both send the same token windows",
    )


class Metric(BaseModel):
    """One aggregate lm-eval reports for a task: a metric under a filter, with its stderr."""

    name: str = Field(description="lm-eval's metric name: acc, acc_norm, bits_per_byte, exact_match ...")
    filter: str = Field("none", description="lm-eval's filter; `none` for most tasks, gsm8k's strict-match")
    value: float
    stderr: float | None = Field(None, description="None where lm-eval gives none ('N/A')")
    higher_is_better: bool = True

    @property
    def id(self) -> str:
        """The metric's name, with its filter where that is not `none`: `acc`, `exact_match/strict-match`."""
        return self.name if self.filter == "none" else f"{self.name}/{self.filter}"


class AccuracyResult(BaseModel):
    """lm-eval's scores, normalised, plus what is needed to reproduce and trust them."""

    scores: dict[str, list[Metric]] = Field(description="per task (and group), every numeric metric reported")
    groups: dict[str, list[str]] = Field({}, description="a group's subtasks, as lm-eval nests them")
    n_samples: dict[str, int] = Field(description="documents evaluated per task")
    versions: dict[str, Any] = Field(description="task versions as lm-eval reports them")
    chance: dict[str, float | None] = Field(description="chance level per task (task metadata `chance`)")
    datasets: dict[str, dict[str, Any]] = Field(description="per task: data source and sha256 of local files")
    backend: str = Field(description="lm-eval model backend used")
    lm_eval_version: str
    seconds: float
    peak_rss_mb: float = Field(description="peak resident memory of the evaluating process")

    def values(self) -> dict[str, dict[str, float]]:
        """task -> metric id -> value."""
        return {t: {m.id: m.value for m in ms} for t, ms in self.scores.items()}

    def higher_is_better(self) -> dict[str, dict[str, bool]]:
        """task -> metric id -> whether higher is better."""
        return {t: {m.id: m.higher_is_better for m in ms} for t, ms in self.scores.items()}


def evaluate_accuracy(cfg: AccuracyConfig, out_dir: Path) -> AccuracyResult:
    """Evaluate `cfg.checkpoint` on `cfg.tasks`; lm-eval's results and per-sample records go to `out_dir`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    manager = TaskManager(include_path=cfg.include_path)
    tasks = _load_tasks(cfg.tasks, manager)
    device = cfg.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = _backend(cfg.backend, device)
    model_args: dict[str, Any] = {
        "pretrained": cfg.checkpoint,
        "dtype": cfg.dtype,
        "trust_remote_code": cfg.trust_remote_code,
    }
    if cfg.kv_cache_dtype != "auto" and backend == "local-completions":
        raise ValueError(f"a {cfg.kv_cache_dtype} KV cache is the server's to keep, not local-completions'")
    if backend == "hf":
        model_args |= {"device": device, "softmax_dtype": cfg.softmax_dtype, "use_safetensors": True}  # never a pickle
        clamp_with_number_bounds()  # a W8A8 or FP8 build's emulated activation quantization, same values, faster
        if cfg.kv_cache_dtype == "fp8":
            model_args["attn_implementation"] = fp8_kv_attention()
    elif backend == "vllm":  # its own FP8 KV cache (lm-eval passes the rest of model_args to vllm.LLM)
        model_args |= {"tensor_parallel_size": cfg.tensor_parallel, "kv_cache_dtype": cfg.kv_cache_dtype}
    elif backend == "local-completions":
        model_args = _served_args(cfg)
    out = lm_eval.simple_evaluate(
        model=backend,
        model_args=model_args,
        tasks=tasks,
        num_fewshot=cfg.num_fewshot,
        limit=cfg.limit,
        batch_size=cfg.batch_size,
        log_samples=True,
        task_manager=manager,
        bootstrap_iters=cfg.bootstrap_iters,
        random_seed=cfg.seed,
        numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed,
    )
    samples = out.pop("samples", {})
    configs = out.get("configs", {})
    generative = [t for t, c in configs.items() if c.get("output_type") == "generate_until" and t in samples]
    if generative:
        _add_generated_ids({t: samples[t] for t in generative}, cfg)
    for task, rows in samples.items():
        with (out_dir / f"samples_{task}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
    (out_dir / "lm_eval_results.json").write_text(json.dumps(out, indent=2, default=str))
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


GENERATED_IDS = "generated_ids"
"""The per-document record's field (generative tasks) holding the generated text's token ids."""


def _add_generated_ids(samples: dict[str, list[dict]], cfg: AccuracyConfig) -> None:
    """Each generative record gets the token ids of its raw generation (`resps`, before any filter), by the
    checkpoint's own tokenizer, the same for the offline and the served backend: what the length rule and
    the greedy departure position are counted in (eval/paired.py). The text is tokenized again, so a
    model that could tokenize its output another way is counted by the canonical tokenization."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.checkpoint, trust_remote_code=cfg.trust_remote_code)
    for rows in samples.values():
        for row in rows:
            text = row["resps"][0][0]
            row[GENERATED_IDS] = tokenizer(text, add_special_tokens=False)["input_ids"]


def generated(folder: Path, result: AccuracyResult, task: str) -> dict[tuple[str, Any], list[int]]:
    """(task, doc_id) -> the generated token ids of a generative task (a group's pooled); empty where the
    task does not generate or its records predate them."""
    out: dict[tuple[str, Any], list[int]] = {}
    for leaf, row in _records(folder, result, task):
        if GENERATED_IDS in row:
            out.setdefault((leaf, row["doc_id"]), row[GENERATED_IDS])
    return out


def _backend(backend: str, device: str) -> str:
    """lm-eval's vLLM backend where vLLM is installed and the device is a GPU, else Hugging Face."""
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


def _load_tasks(names: list[str], manager) -> list:
    """lm-eval Task objects; one clear error naming the task that is unknown or cannot be loaded."""
    from lm_eval.tasks import get_task_dict

    for name in names:
        if name not in manager.all_tasks:
            hint = suggest(name, manager.all_tasks, n=3)
            raise ValueError(f"unknown lm-eval task '{name}'{hint}; list them with `lm-eval ls tasks`")
    tasks = []
    for name in names:
        try:
            tasks.extend(get_task_dict([name], manager).values())
        except Exception as e:
            offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if offline:
                raise ValueError(
                    f"task '{name}' needs its data set from the hub, which is off here ({why}); where the hub is "
                    f"reachable set QEVAL_ALLOW_HUB=1 once to fill the cache, or write a local task YAML with "
                    f"dataset_path: json"
                ) from None
            raise ValueError(f"task '{name}' could not be loaded: {why}") from None
    return tasks


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


# ---- lm-eval's formats, read here and nowhere else -------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def scores(results: dict[str, dict[str, Any]], higher_is_better: dict[str, dict[str, bool]]) -> dict[str, list[Metric]]:
    """lm-eval's `results` section (keys `metric,filter`, stderrs as `metric_stderr,filter`) as Metrics."""
    out: dict[str, list[Metric]] = {}
    for task, values in results.items():
        metrics = []
        for key, value in values.items():
            name, sep, filt = key.partition(",")
            if not sep or name.endswith("_stderr") or _number(value) is None:
                continue  # `alias`, `samples`, stderrs (taken with their metric), text
            metrics.append(
                Metric(
                    name=name,
                    filter=filt or "none",
                    value=_number(value),
                    stderr=_number(values.get(f"{name}_stderr,{filt}")),
                    higher_is_better=(higher_is_better.get(task) or {}).get(name, True),
                )
            )
        out[task] = metrics
    return out


def leaves(task: str, groups: dict[str, list[str]]) -> list[str]:
    """The tasks with per-document records under `task`: itself, or a group's subtasks, recursively."""
    if task not in groups:
        return [task]
    return [leaf for sub in groups[task] for leaf in leaves(sub, groups)]


def _samples(folder: Path, task: str) -> Path:
    path = folder / f"samples_{task}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no per-document records {path}")
    return path


def document_metrics(folder: Path, result: AccuracyResult, task: str) -> list[Metric]:
    """The task's reported metrics that also have per-document values (a group: those of its first leaf)."""
    first = leaves(task, result.groups)[0]
    with _samples(folder, first).open() as f:
        row = json.loads(f.readline())
    reported = result.scores.get(task) or result.scores.get(first) or []
    return [m for m in reported if m.name in row]


def documents(folder: Path, result: AccuracyResult, task: str, metric: Metric) -> dict[tuple[str, Any], Any]:
    """(task, doc_id) -> the metric's per-document value: a score, or [log-likelihood, length] for
    perplexity-type metrics. A group's documents are pooled, which weighs each subtask by its size as
    lm-eval's groups do."""
    out = {}
    for leaf, row in _records(folder, result, task):
        if row.get("filter", metric.filter) == metric.filter and metric.name in row:
            value = row[metric.name]
            out[(leaf, row["doc_id"])] = tuple(value) if isinstance(value, list) else value
    return out


def _records(folder: Path, result: AccuracyResult, task: str) -> Iterator[tuple[str, dict]]:
    """(leaf task, per-document record) for `task`, a group's subtasks in turn."""
    for leaf in leaves(task, result.groups):
        with _samples(folder, leaf).open() as f:
            for line in f:
                yield leaf, json.loads(line)


def task_files(include: Path, root: Path) -> list[Path]:
    """A local task folder's YAMLs, the Python files beside them (a YAML's `!function` names one: its
    scoring) and the data files they name (relative to `root`, where lm-eval runs), so that editing any
    reruns a stage."""
    import yaml

    class _TaskYamlLoader(yaml.SafeLoader):
        """Reads task YAMLs, whose `!function` tags name Python code not needed here."""

    _TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
    files = sorted(include.glob("*.yaml"))
    for f in list(files):
        spec = yaml.load(f.read_text(), Loader=_TaskYamlLoader) or {}
        data_files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
        for value in data_files.values() if isinstance(data_files, dict) else [data_files]:
            path = Path(value) if isinstance(value, str) else None
            if path is not None and not path.is_absolute():
                path = root / path
            if path is not None and path.is_file():
                files.append(path)
    return files + sorted(include.glob("*.py"))
