"""Accuracy of one build with lm-evaluation-harness (the only module that imports lm_eval).

evaluate_accuracy() writes lm_eval_results.json (lm-eval's own result document, samples removed) and
samples_<task>.jsonl (per-document records, for paired statistics) to its output folder. The
pipeline runs it in a fresh process per build (pipelines/child.py).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import resource
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AccuracyConfig(BaseModel):
    """What to evaluate and how; identical for every build of a model except `checkpoint`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(description="local folder of the saved build (HF format)")
    tasks: list[str] = Field(min_length=1, description="lm-eval task names")
    include_path: str | None = Field(None, description="folder of local task YAMLs")
    num_fewshot: int = Field(0, ge=0)
    limit: int | None = Field(None, gt=0, description="documents per task (None: all)")
    batch_size: int = Field(8, gt=0)
    seed: int = Field(1234, description="seed for python, numpy, torch and few-shot sampling")
    device: str = Field("auto", description="torch device; auto: cuda where available, else cpu")
    dtype: str = Field("bfloat16", description="dtype the (dequantized) weights compute in")
    softmax_dtype: str = Field(
        "float32",
        description="dtype of log-softmax and log-likelihood sums: in bf16 a chapter's sum is rounded to "
        "steps of 16 nats, hiding the small differences between builds that matter here",
    )
    trust_remote_code: bool = False
    backend: Literal["auto", "hf", "vllm"] = Field("auto", description="vllm where installed and on a GPU")


class AccuracyResult(BaseModel):
    """lm-eval's `results` section plus what is needed to reproduce and trust it."""

    results: dict[str, dict[str, Any]]
    n_samples: dict[str, int] = Field(description="documents evaluated per task")
    versions: dict[str, Any] = Field(description="task versions as lm-eval reports them")
    higher_is_better: dict[str, dict[str, bool]] = Field(description="per task and metric, from lm-eval")
    chance: dict[str, float | None] = Field(description="chance level per task (task metadata `chance`)")
    datasets: dict[str, dict[str, Any]] = Field(description="per task: data source and sha256 of local files")
    backend: str = Field(description="lm-eval model backend used")
    lm_eval_version: str
    seconds: float
    peak_rss_mb: float = Field(description="peak resident memory of the evaluating process")


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
    if backend == "hf":
        model_args |= {"device": device, "softmax_dtype": cfg.softmax_dtype}
    out = lm_eval.simple_evaluate(
        model=backend,
        model_args=model_args,
        tasks=tasks,
        num_fewshot=cfg.num_fewshot,
        limit=cfg.limit,
        batch_size=cfg.batch_size,
        log_samples=True,
        task_manager=manager,
        bootstrap_iters=1000,
        random_seed=cfg.seed,
        numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed,
    )
    samples = out.pop("samples", {})
    for task, rows in samples.items():
        with (out_dir / f"samples_{task}.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
    (out_dir / "lm_eval_results.json").write_text(json.dumps(out, indent=2, default=str))
    configs = out.get("configs", {})
    return AccuracyResult(
        results={t: dict(v) for t, v in out["results"].items()},
        n_samples={t: int(v["effective"]) for t, v in out.get("n-samples", {}).items()},
        versions=dict(out.get("versions", {})),
        higher_is_better={t: dict(v) for t, v in out.get("higher_is_better", {}).items()},
        chance={t: (c.get("metadata") or {}).get("chance") for t, c in configs.items()},
        datasets={t: _dataset_identity(c) for t, c in configs.items()},
        backend=backend,
        lm_eval_version=lm_eval.__version__ if hasattr(lm_eval, "__version__") else "unknown",
        seconds=round(time.perf_counter() - t0, 2),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )


def _backend(backend: str, device: str) -> str:
    """lm-eval's vLLM backend where vLLM is installed and the device is a GPU, else Hugging Face."""
    if backend != "auto":
        return backend
    return "vllm" if device.startswith("cuda") and importlib.util.find_spec("vllm") else "hf"


def _load_tasks(names: list[str], manager) -> list:
    """lm-eval Task objects; one clear error naming the task that is unknown or cannot be loaded."""
    from lm_eval.tasks import get_task_dict

    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
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
