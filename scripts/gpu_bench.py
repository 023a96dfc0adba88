"""GPU engine benchmark on Llama-2-7B's shape with random weights (no download), bf16.

    python scripts/gpu_bench.py [--batches 1 8 32] [--input 128] [--output 128] [--config SHAPE.json]

Needs only torch, transformers, pydantic and psutil (the device machine has the first two; bring the
others as wheels). Prints TTFT, decode tokens/s per user and in total, peak memory and MBU per batch,
then one JSON document. Decode uses a static KV cache and a compiled decode step (eval/engine.py); if
compilation fails the reason is printed and the figures are eager. Target: MBU >= 0.6 for bf16 decode
at batch 1 (gpt-fast reaches about 0.7 on an A100); meant to finish within 8 minutes (one compile per
batch size), not yet timed on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.engine import EngineConfig, bench_engine

SHAPE = Path(__file__).resolve().parent.parent / "eval" / "configs" / "llama-2-7b.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input", type=int, default=128)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--config", type=Path, default=SHAPE, help="a config.json giving the shape")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shape = Path(tmp) / "config.json"
        shape.write_text(args.config.read_text())
        cfg = EngineConfig(
            checkpoint=tmp,
            precision="bf16",
            no_weights=True,
            batch_sizes=args.batches,
            input_lengths=[args.input],
            output_lengths=[args.output],
            warmup=2,
            repeats=args.repeats,
        )
        result = bench_engine(cfg, Path(tmp))
    print(f"{result.device_name}, {result.engine}, {result.dtype}, random weights of {args.config.stem}'s shape")
    if result.compile_error:
        print(f"torch.compile failed, measured eager: {result.compile_error}")
    print(
        f"weights {result.weight_bytes / 1e9:.2f} GB, peak bandwidth {result.bandwidth_gb_s:.0f} GB/s "
        f"({result.bandwidth_source}), {args.input} in / {args.output} out, median of {args.repeats}"
    )
    print(f"{'batch':>5} {'TTFT ms':>9} {'tok/s/user':>11} {'tok/s total':>12} {'peak GB':>8} {'MBU':>6}")
    for pt in result.points:
        if pt.status != "ok":
            print(f"{pt.batch:>5} {pt.status}")
            continue
        print(
            f"{pt.batch:>5} {pt.ttft_ms_p50:>9.1f} {pt.decode_tps_per_user:>11.1f} {pt.decode_tps_total:>12.1f} "
            f"{pt.peak_mem_bytes / 1e9:>8.2f} {pt.mbu:>6.2f}"
        )
    print(json.dumps(result.model_dump()))


if __name__ == "__main__":
    main()
