"""GPU smoke check: qeval's GPU paths in one call that a lent GPU machine can run (docs/gpu.md).

    python scripts/gpu_bench.py [--out DIR] [--parts device quantize evaluate bench shape]

Needs torch and transformers (the lent machine has them); quantize needs llm-compressor and compressed-tensors,
evaluate lm-eval, every part pydantic: `scripts/gpu_wheels.sh` downloads them as wheels to carry. A part whose
libraries do not import says so and the others run. Parts, each timed:
- device: what torch sees, the catalog entry qeval names it by, and the key qeval's cache records for it;
- quantize: ref-lm to FP8, INT8 (W8A8) and GPTQ 4-bit with llm-compressor, which calibrates on the GPU, each
  proven against the baseline with both models on the GPU (quant/verify.py);
- evaluate: ref-lm's local tasks (first documents only) with lm-eval's transformers backend on the GPU, the
  baseline and every build (the engine of record there is vLLM, which this machine lacks);
- bench: the engine bench on ref-lm's baseline and builds (static KV cache, compiled decode);
- shape: the engine bench on Llama-2-7B's shape with random weights in bf16 (TTFT, decode tokens/s, peak
  memory, MBU against the data sheet's bandwidth).
Prints one line per part, then one JSON document, also written to DIR/gpu_bench.json.
"""

from __future__ import annotations

import argparse
import json
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
PARTS = ("device", "quantize", "evaluate", "bench", "shape")


def device() -> dict:
    import torch

    from eval.gpus import gpu_for_device
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

    calibration = CalibrationSpec(str(REPO / "refmodel/data/calibration.jsonl"), "train", "text", 59, 512)
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
    from eval.accuracy import AccuracyConfig, evaluate_accuracy

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
) -> dict:
    from eval.engine import EngineConfig, bench_engine

    folder.mkdir(parents=True, exist_ok=True)
    cfg = EngineConfig(
        checkpoint=str(checkpoint),
        precision=precision,
        no_weights=no_weights,
        batch_sizes=batches,
        input_lengths=[input_len],
        output_lengths=[output_len],
        warmup=2,
        repeats=5,
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
            out[precision] = _bench(checkpoint, precision, False, [1, 8], 128, 64, work / f"bench-{precision}")
    return out


def shape(work: Path) -> dict:
    (work / "shape").mkdir(parents=True, exist_ok=True)
    (work / "shape" / "config.json").write_text(SHAPE.read_text())
    return _bench(work / "shape", "bf16", True, [1, 8, 32], 128, 128, work / "shape")


def _part(name: str, fn: Callable[[], dict]) -> dict:
    t0 = time.perf_counter()
    try:
        result = {"ok": True, **fn()}
    except ImportError as e:
        result = {"ok": False, "skipped": f"{e.name or e} is not importable here (carry it: scripts/gpu_wheels.sh)"}
    except Exception as e:  # a smoke check reports every part's failure and goes on to the next
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-3000:]}
    result["part_s"] = round(time.perf_counter() - t0, 1)
    shown = {k: v for k, v in result.items() if k != "trace"}
    print(f"{name}: {json.dumps(shown)[:2000]}", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_bench.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        steps = {
            "device": device,
            "quantize": lambda: quantize(work),
            "evaluate": lambda: evaluate(work),
            "bench": lambda: bench(work),
            "shape": lambda: shape(work),
        }
        report = {name: _part(name, steps[name]) for name in PARTS if name in args.parts}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
