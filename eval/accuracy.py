"""Accuracy of one build with lm-evaluation-harness (the only module that imports lm_eval).

evaluate_accuracy() writes lm_eval_results.json (lm-eval's own result document, samples removed) and
samples_<task>.jsonl (per-document records, for paired statistics) to its output folder. The
pipeline runs it in a fresh process per build (pipelines/child.py).
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

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
    device: str = Field("cpu", description="torch device for the HF backend")
    dtype: str = Field("bfloat16", description="dtype the (dequantized) weights compute in")
    trust_remote_code: bool = False


class AccuracyResult(BaseModel):
    """lm-eval's `results` section plus what is needed to reproduce and trust it."""

    results: dict[str, dict[str, Any]]
    n_samples: dict[str, int] = Field(description="documents evaluated per task")
    versions: dict[str, Any] = Field(description="task versions as lm-eval reports them")
    lm_eval_version: str
    seconds: float
    peak_rss_mb: float = Field(description="peak resident memory of the evaluating process")


def evaluate_accuracy(cfg: AccuracyConfig, out_dir: Path) -> AccuracyResult:
    """Evaluate `cfg.checkpoint` on `cfg.tasks`; lm-eval's results and per-sample records go to `out_dir`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    manager = TaskManager(include_path=cfg.include_path)
    unknown = [t for t in cfg.tasks if t not in manager.all_tasks]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ValueError(f"unknown lm-eval task '{unknown[0]}'{hint}; list them with `lm-eval ls tasks`")
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={
            "pretrained": cfg.checkpoint,
            "dtype": cfg.dtype,
            "device": cfg.device,
            "trust_remote_code": cfg.trust_remote_code,
        },
        tasks=list(cfg.tasks),
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
    return AccuracyResult(
        results={t: dict(v) for t, v in out["results"].items()},
        n_samples={t: int(v["effective"]) for t, v in out.get("n-samples", {}).items()},
        versions=dict(out.get("versions", {})),
        lm_eval_version=lm_eval.__version__ if hasattr(lm_eval, "__version__") else "unknown",
        seconds=round(time.perf_counter() - t0, 2),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )
