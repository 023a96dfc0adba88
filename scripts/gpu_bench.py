"""GPU smoke check: qeval's GPU paths in one call that a lent GPU machine can run (docs/gpu.md, "A lent GPU").

    python scripts/gpu_bench.py [--out DIR] [--parts ...] [--budget-s 480]

Needs torch and transformers (the lent machine has them); quantize needs llm-compressor, evaluate lm-eval, every
part pydantic: `scripts/gpu_wheels.py` downloads them, with their dependencies, as wheels to carry. Parts, most
informative first, so that a call cut short keeps what matters most:
- device: what torch sees, the catalog entry qeval names it by, and the key qeval's cache records for it;
- shape_eager: the engine bench on Llama-2-7B's shape with random weights in bf16, eager (TTFT, decode tokens/s,
  peak memory, MBU against the data sheet's bandwidth): the only figures at a real model's size;
- shape_compiled: the same shape with the static KV cache and decode compiled, at one user (what compiling buys);
- quantize: ref-lm to FP8, INT8 (W8A8) and GPTQ 4-bit with llm-compressor, which calibrates on the GPU, each
  proven against the baseline with both models on the GPU (quant/verify.py);
- evaluate: ref-lm's local tasks (first documents only) with lm-eval's transformers backend on the GPU, the
  baseline and every build (the engine of record there is vLLM, which this machine lacks);
- bench: the engine bench on ref-lm's baseline and builds, eager.
Each part runs within its own cap (CAP_S) and what is left of the budget, and is stopped where it runs past them;
gpu_bench.json is written after every part, so a call that times out keeps every part that finished. Prints one
line per part, then one JSON document.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REF_LM = REPO / "refmodel" / "ref-lm"
SHAPE = REPO / "pipelines" / "models" / "configs" / "llama-2-7b.json"
BUILDS = ("fp8", "int8", "gptq")
CAP_S = {"device": 60, "shape_eager": 120, "shape_compiled": 180, "quantize": 150, "evaluate": 90, "bench": 120}
"""Each part's own bound, in the order they run (the most informative first)."""
PARTS = tuple(CAP_S)
BUDGET_S = 480
"""All parts together: a lent machine's call is at most 600 s, and installing the carried wheels and starting Python
come first (docs/gpu.md)."""
MIN_PART_S = 15  # a part is not started with less than this left of the budget


def device() -> dict:
    import torch

    from eval.devices.gpus import gpu_for_device
    from pipelines.core.system.device import from_probe, probe

    found = from_probe(probe())  # what qeval's stages ask of torch, in a child process, as they do
    gpu = gpu_for_device(found.name) if found.name else None
    memory = round(found.memory_bytes / 2**30, 2) if found.memory_bytes else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "key": found.key(),
        "memory_gib": memory,
        "catalog": gpu.name if gpu else None,
        "catalog_memory_gib": round(gpu.memory_gib, 2) if gpu else None,
    }


def quantize(work: Path) -> dict:
    import torch

    from quant.build import QuantizeConfig, quantize_checkpoint
    from quant.calibration import CalibrationSpec
    from quant.recipes import GROUP_SIZE, IGNORE
    from quant.verify import VerifyConfig, verify_checkpoint

    calibration = CalibrationSpec(str(REPO / "refmodel/data/calibration.jsonl"), "train", "text", 60, 512)
    out = {}
    for precision in BUILDS:
        folder = work / precision
        folder.mkdir(parents=True, exist_ok=True)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        cfg = QuantizeConfig(
            base=str(REF_LM),
            precision=precision,
            group_size=GROUP_SIZE,
            ignore=list(IGNORE),
            calibration=None if precision == "fp8" else calibration,
        )
        made = quantize_checkpoint(cfg, folder)
        built = time.perf_counter() - t0
        proof = verify_checkpoint(
            VerifyConfig(base=str(REF_LM), checkpoint=str(folder / "checkpoint"), precision=precision), folder
        )
        out[precision] = {
            "build_s": round(built, 2),
            "proof_s": round(time.perf_counter() - t0 - built, 2),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3) if torch.cuda.is_available() else None,
            "checkpoint_bytes": made.checkpoint_bytes,
            "kl": proof.kl_vs_baseline,
            "top1": proof.top1_agreement,
        }
    return out


def evaluate(work: Path) -> dict:
    from eval.quality.accuracy import AccuracyConfig, evaluate_accuracy

    tasks = ["refkjv_ppl", "refkjv_next_verse", "refkjv_continue"]
    out = {}
    for precision in ("bf16", *BUILDS):
        checkpoint = REF_LM if precision == "bf16" else work / precision / "checkpoint"
        if not checkpoint.is_dir():
            out[precision] = "not built"
            continue
        folder = work / f"eval-{precision}"
        folder.mkdir(parents=True, exist_ok=True)
        cfg = AccuracyConfig(
            checkpoint=str(checkpoint),
            tasks=tasks,
            include_path=str(REPO / "eval/tasks/refkjv"),
            limit=20,
            batch_size=32,
            seed=1234,
            backend="hf",
            max_length=512,
        )
        result = evaluate_accuracy(cfg, folder)
        out[precision] = {
            "seconds": result.seconds,
            **{t: {m.id: round(m.value, 5) for m in ms} for t, ms in result.scores.items()},
        }
    return out


def _bench(
    checkpoint: Path,
    precision: str,
    no_weights: bool,
    batches: list[int],
    input_len: int,
    output_len: int,
    folder: Path,
    compiled: bool,
) -> dict:
    from eval.bench.engine import EngineConfig, bench_engine

    folder.mkdir(parents=True, exist_ok=True)
    cfg = EngineConfig(
        checkpoint=str(checkpoint),
        precision=precision,
        no_weights=no_weights,
        batch_sizes=batches,
        input_lengths=[input_len],
        output_lengths=[output_len],
        warmup=1,
        repeats=3,
        compile=compiled,
    )
    t0 = time.perf_counter()
    r = bench_engine(cfg, folder)
    return {
        "seconds": round(time.perf_counter() - t0, 1),
        "engine": r.engine,
        "compile_error": r.compile_error,
        "execution": str(r.execution),
        "weight_gb": round(r.weight_bytes / 1e9, 4),
        "bandwidth_gb_s": round(r.bandwidth_gb_s),
        "bandwidth_source": r.bandwidth_source,
        "points": [
            {
                "batch": p.batch,
                "status": p.status,
                "ttft_ms": p.ttft_ms_p50,
                "ttft_ms_p90": p.ttft_ms_p90,
                "tpot_ms": p.tpot_ms_p50,
                "tok_s_user": p.decode_tps_per_user,
                "tok_s": p.decode_tps_total,
                "peak_gb": p.peak_mem_bytes and round(p.peak_mem_bytes / 1e9, 3),
                "mbu": p.mbu,
                "compile_error": p.compile_error,
            }
            for p in r.points
        ],
    }


def bench(work: Path) -> dict:
    out = {}
    for precision in ("bf16", *BUILDS):
        checkpoint = REF_LM if precision == "bf16" else work / precision / "checkpoint"
        if checkpoint.is_dir():
            out[precision] = _bench(checkpoint, precision, False, [1, 8], 128, 64, work / f"bench-{precision}", False)
    return out


def shape(work: Path, compiled: bool) -> dict:
    folder = work / ("shape-compiled" if compiled else "shape-eager")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(SHAPE.read_text())
    return _bench(folder, "bf16", True, [1] if compiled else [1, 8], 128, 128, folder, compiled)


class PartTimeout(Exception):
    """A part ran past its bound."""


def _stop_at(seconds: float) -> None:
    def stop(signum, frame):
        raise PartTimeout(f"stopped after {seconds:.0f} s, its bound")

    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _release() -> None:
    """What a part left on the GPU, freed before the next one."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()


def _part(name: str, fn: Callable[[], dict], bound: float) -> dict:
    t0 = time.perf_counter()
    try:
        _stop_at(bound)
        result = {"ok": True, **fn()}
    except PartTimeout as e:
        result = {"ok": False, "timed_out": str(e)}
    except ImportError as e:
        result = {"ok": False, "skipped": f"{e.name or e} is not importable here (carry it: scripts/gpu_wheels.py)"}
    except Exception as e:  # a smoke check reports every part's failure and goes on to the next
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-3000:]}
    finally:
        _release()
    result["part_s"] = round(time.perf_counter() - t0, 1)
    shown = {k: v for k, v in result.items() if k != "trace"}
    print(f"{name}: {json.dumps(shown)[:2000]}", flush=True)
    return result


def steps(work: Path) -> dict[str, Callable[[], dict]]:
    """Each part's work, by name."""
    return {
        "device": device,
        "shape_eager": lambda: shape(work, compiled=False),
        "shape_compiled": lambda: shape(work, compiled=True),
        "quantize": lambda: quantize(work),
        "evaluate": lambda: evaluate(work),
        "bench": lambda: bench(work),
    }


def run(parts: list[str], budget_s: float, out: Path | None, work: Path) -> dict:
    """The parts in PARTS' order, each within its cap and the budget left; the report after each to `out`."""
    t0, report = time.monotonic(), {}
    todo = steps(work)
    for name in (p for p in PARTS if p in parts):
        left = budget_s - (time.monotonic() - t0)
        if left < MIN_PART_S:
            report[name] = {"ok": False, "not_run": f"{max(left, 0):.0f} s of the {budget_s:.0f} s budget left"}
        else:
            report[name] = _part(name, todo[name], min(CAP_S[name], left))
        if out is not None:
            _write(out, report)
    return report


def _write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "gpu_bench.json.partial"
    partial.write_text(json.dumps(report, indent=2, default=str))
    partial.replace(out / "gpu_bench.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_bench.json, written after every part")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all parts together")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = run(args.parts, args.budget_s, args.out, Path(tmp))
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
