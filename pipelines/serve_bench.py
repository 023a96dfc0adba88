"""The serve stage: a real OpenAI-compatible server per build, swept over concurrency under the card's SLO.

The server is `transformers serve --continuous-batching` on the build's checkpoint, or `vllm serve`
where vLLM is installed and a GPU is present (card `server.engine`), or one the user runs (`--url`).
It binds a free port on 127.0.0.1, its log is kept, and it is stopped with everything it started on
every way out. The load generator (eval/loadgen.py) measures its own ceiling against a minimal local
streaming endpoint (eval/stream_stub.py) in the same stage, so that a slow generator cannot pass for
a slow server. Metrics: `server/*` with step = concurrency; `server/max_users_at_slo`.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import eval.loadgen as loadgen
import eval.serving as serving
from pipelines.cards import ModelCard, offline_env
from pipelines.errors import QevalError
from pipelines.procs import running
from pipelines.quantize import checkpoint_for
from pipelines.stages import StageOutput, StageRecord, run_stage
from pipelines.tracking import Tracker

STAGE = "serve"
log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
SERIES = [
    "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50",
    "e2e_ms_p99", "output_tps", "output_tps_per_user", "request_tps", "goodput", "slo_attainment", "failed",
]  # fmt: skip
CEILING_OUTPUT = 256  # chunks per request against the stub


def served_model(url: str, default: str) -> str:
    """The first model a running server lists at /v1/models (the name it expects), else `default`."""
    import httpx

    try:
        models = httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json().get("data") or []
        return models[0]["id"] if models else default
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return default


def choose_engine(engine: str) -> str:
    if engine != "auto":
        return engine
    if importlib.util.find_spec("vllm") is None:
        return "transformers"
    import torch

    return "vllm" if torch.cuda.is_available() else "transformers"


CB_BLOCK = 256  # tokens per KV-cache block of transformers' continuous batching (its default)


def server_command(
    engine: str,
    checkpoint: str,
    trust_remote_code: bool,
    port: str = "{port}",
    *,
    max_sequences: int = 64,
    input_len: int = 2048,
    output_len: int = 256,
) -> list[str]:
    """The command that serves `checkpoint` on 127.0.0.1 (`{port}` is filled in by procs.running).

    On a CPU, transformers' continuous batching sizes its KV cache from the machine's free memory (12 GB
    of 24 here, which the kernel's OOM killer took back once other work ran): the cache is sized for
    the sweep instead, `max_sequences` of input + output tokens with room to spare.
    """
    if engine == "vllm":
        beside = Path(sys.executable).with_name("vllm")  # the virtual environment's, when not on PATH
        cmd = [str(beside) if beside.exists() else "vllm", "serve", checkpoint, "--host", "127.0.0.1", "--port", port]
        return cmd + (["--trust-remote-code"] if trust_remote_code else [])
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", checkpoint, "--continuous-batching"]
    cmd += ["--host", "127.0.0.1", "--port", port, "--device", device, "--log-level", "info"]
    if device == "cpu":
        blocks = 2 * max_sequences * -(-(input_len + output_len) // CB_BLOCK) + 8
        batch_tokens = min(8192, max(512, max_sequences * input_len))
        cmd += ["--cb-num-blocks", str(blocks)]
        cmd += ["--cb-max-batch-tokens", str(batch_tokens)]
    return cmd + (["--trust-remote-code"] if trust_remote_code else [])


def generator_ceiling(work: Path, concurrency: int, requests_per_user: int) -> dict[str, float]:
    """Streamed chunks per second the generator takes in from an endpoint that answers instantly."""
    cmd = [sys.executable, "-m", "eval.stream_stub", "--port", "{port}"]
    with running(cmd, work / "stub.log", 60, "the stub endpoint") as url:
        cfg = loadgen.LoadConfig(
            url=url, model="stub", concurrency=[concurrency], requests_per_user=requests_per_user, warmup=1,
            input_len=1, output_len=CEILING_OUTPUT, timeout_s=60,
        )  # fmt: skip
        records = loadgen.sweep(cfg, ["x"])
    ok = [r for r in records if r.ok]
    span = max(r.end for r in records) - min(r.start for r in records)
    chunks = sum(len(r.token_times) for r in ok)
    return {"chunks_per_s": chunks / span, "concurrency": concurrency, "failed": len(records) - len(ok)}


def serve_bench(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, url: str | None = None
) -> StageRecord:
    """Sweep one build's server over the card's concurrency levels and log it."""
    checkpoint, checkpoint_id = checkpoint_for(card, precision)
    srv, s = card.server, card.speed
    engine = "external" if url else choose_engine(srv.engine)
    load = {
        "api": srv.api,
        "concurrency": s.concurrency,
        "requests_per_user": srv.requests_per_user,
        "warmup": srv.warmup,
        "input_len": s.input_lengths[0],
        "output_len": s.output_lengths[0],
        "exact_length": {"vllm": "ignore_eos", "transformers": "generation_config"}.get(engine, "none"),
        "timeout_s": srv.timeout_s,
    }
    slo = serving.Slo(s.slo.ttft_ms, s.slo.tpot_ms)
    inputs = {"checkpoint": checkpoint_id, "engine": engine, "url": url, "load": load, "slo": s.slo.model_dump()}

    def work(out: Path) -> StageOutput:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=card.source.trust_remote_code)
        prompts = loadgen.synthetic_prompts(tokenizer, 16, load["input_len"])
        ceiling = generator_ceiling(out, 4 * max(s.concurrency), 4)
        log.info(
            "load generator ceiling: %.0f chunks/s at concurrency %d", ceiling["chunks_per_s"], 4 * max(s.concurrency)
        )

        def progress(c: int, level: list) -> None:
            m = serving.level_metrics(level, slo)
            log.info(
                "%s@%s concurrency %d: %d requests, %d failed, TTFT p50 %.0f ms, TPOT p50 %.1f ms, %.1f tok/s",
                card.name, precision, c, m["requests"], m["failed"], m.get("ttft_ms_p50", float("nan")),
                m.get("tpot_ms_p50", float("nan")), m.get("output_tps", 0.0),
            )  # fmt: skip

        def sweep(base_url: str) -> list[serving.RequestRecord]:
            model = served_model(base_url, checkpoint) if engine == "external" else checkpoint
            cfg = loadgen.LoadConfig(url=base_url, model=model, **load)
            try:
                return loadgen.sweep(cfg, prompts, progress)
            except RuntimeError as e:
                where = f"the server at {url}" if url else f"the server's log {out / 'server.log'}"
                raise QevalError(f"{card.name}@{precision} server: {e}; check {where}") from None

        if url:
            records = sweep(url)
        else:
            cmd = server_command(
                engine, checkpoint, card.source.trust_remote_code, max_sequences=max(s.concurrency),
                input_len=load["input_len"], output_len=load["output_len"],
            )  # fmt: skip
            what = f"{engine} serve for {card.name}@{precision}"
            with running(cmd, out / "server.log", srv.start_timeout_s, what, offline_env(card)) as base_url:
                records = sweep(base_url)
        serving.write_csv(records, out / "requests.csv")
        per_level = serving.sweep_metrics(records, slo)
        users = serving.max_users_at_slo(per_level)
        peak = max((m.get("output_tps", 0.0) for m in per_level.values()), default=0.0)
        series = {f"server/{name}": [(c, m[name]) for c, m in per_level.items() if name in m] for name in SERIES}
        failed = sum(int(m["failed"]) for m in per_level.values())
        metrics = {
            "server/max_users_at_slo": float(users),
            "server/failed_requests": float(failed),
            "server/generator_ceiling_chunks_s": ceiling["chunks_per_s"],
        }
        if ceiling["chunks_per_s"] < 10 * peak:
            log.warning(
                "the load generator's ceiling (%.0f chunks/s) is under 10x the server's peak %.0f tokens/s: "
                "its figures may be the generator's",
                ceiling["chunks_per_s"],
                peak,
            )
        return StageOutput(
            metrics=metrics,
            series=series,
            params={
                "server.engine": engine,
                "server.api": srv.api,
                "server.exact_length": load["exact_length"],
                "server.requests_per_user": str(srv.requests_per_user),
                "server.slo": f"TTFT p95 <= {s.slo.ttft_ms:g} ms, TPOT p95 <= {s.slo.tpot_ms:g} ms",
            },
            summary={
                "engine": engine,
                "per_level": {str(c): m for c, m in per_level.items()},
                "max_users_at_slo": users,
                "generator_ceiling": ceiling,
                "generator_bound": ceiling["chunks_per_s"] < 10 * peak,
                "failed_requests": failed,
            },
        )

    return run_stage(tracker, precision, STAGE, inputs, _code(), work, force=force)


def _code() -> list[Path]:
    return [Path(loadgen.__file__), Path(serving.__file__), Path(loadgen.__file__).with_name("stream_stub.py"),
            Path(__file__)]  # fmt: skip
