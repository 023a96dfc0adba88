"""Accuracy of one build with lm-evaluation-harness, run in a fresh Python process.

    python -m eval.accuracy CONFIG.json OUT_DIR      # what evaluate_accuracy() runs

A fresh process per build keeps one build's weights and kernels from leaking into another's run. OUT_DIR
receives lm_eval_results.json (lm-eval's own result document, samples removed), samples_<task>.jsonl
(per-document records for paired statistics) and result.json (an AccuracyResult), or error.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

REPO_ROOT = Path(__file__).resolve().parent.parent


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
    offline: bool = Field(True, description="forbid hub access (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE)")


class AccuracyResult(BaseModel):
    """lm-eval's `results` section plus what is needed to reproduce and trust it."""

    results: dict[str, dict[str, Any]]
    n_samples: dict[str, int] = Field(description="documents evaluated per task")
    versions: dict[str, Any] = Field(description="task versions as lm-eval reports them")
    lm_eval_version: str
    seconds: float
    peak_rss_mb: float = Field(description="peak resident memory of the evaluating process")


def evaluate_accuracy(cfg: AccuracyConfig, out_dir: Path, log_file: Path | None = None) -> AccuracyResult:
    """Evaluate `cfg.checkpoint` on `cfg.tasks` in a child process; raise RuntimeError on failure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "accuracy_config.json"
    cfg_path.write_text(cfg.model_dump_json(indent=2))
    env = dict(os.environ)
    if cfg.offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "eval.accuracy", str(cfg_path), str(out_dir)]
    log = open(log_file, "ab") if log_file else None  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):  # progress bars pass through
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
            if log:
                log.write(chunk)
        code = proc.wait()
    finally:
        if log:
            log.close()
    if (out_dir / "error.json").is_file():
        raise RuntimeError(json.loads((out_dir / "error.json").read_text())["error"])
    if code != 0 or not (out_dir / "result.json").is_file():
        raise RuntimeError(f"lm-eval exited with status {code}; see {log_file or 'stderr'}")
    return AccuracyResult.model_validate_json((out_dir / "result.json").read_text())


def _run(cfg: AccuracyConfig, out_dir: Path) -> AccuracyResult:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    manager = TaskManager(include_path=cfg.include_path)
    unknown = [t for t in cfg.tasks if t not in manager.all_tasks]
    if unknown:
        import difflib

        hints = {t: difflib.get_close_matches(t, manager.all_tasks, n=3) for t in unknown}
        raise ValueError(f"unknown lm-eval task(s): {hints} (name: close matches)")
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


def main(argv: list[str]) -> int:
    cfg_path, out_dir = Path(argv[0]), Path(argv[1])
    cfg = AccuracyConfig.model_validate_json(cfg_path.read_text())
    try:
        result = _run(cfg, out_dir)
    except Exception as e:  # reported to the parent as one line; the traceback stays in the log
        import traceback

        traceback.print_exc()
        (out_dir / "error.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 2
    (out_dir / "result.json").write_text(result.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
