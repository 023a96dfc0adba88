"""The serve stage: a real OpenAI-compatible server per build, swept over concurrency under the card's SLO.

The server is `transformers serve --continuous-batching` on the build's checkpoint, or `vllm serve`
where vLLM is installed and a GPU is present (card `server.engine`), or one the user runs (`--url`).
It binds a free port on 127.0.0.1, its log is kept, and it is stopped with everything it started on
every way out. The load generator (eval/loadgen.py) measures its own ceiling against a minimal local
streaming endpoint (eval/stream_stub.py) in the same stage, so that a slow generator cannot pass for
a slow server.
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
from pipelines.results import GeneratorCeiling, Served, checkpoint_for
from pipelines.stages import StageRecord, run_stage
from pipelines.tracking import Tracker

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
CEILING_OUTPUT = 256  # chunks per request against the stub
CB_BLOCK = 256  # tokens per KV-cache block of transformers' continuous batching (its default)
EXACT_LENGTH = {"vllm": "ignore_eos", "transformers": "generation_config"}  # how each engine is held to a length


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


def generator_ceiling(work: Path, concurrency: int, requests_per_user: int) -> GeneratorCeiling:
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
    return GeneratorCeiling(chunks_per_s=chunks / span, concurrency=concurrency, failed=len(records) - len(ok))


def serve_bench(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, url: str | None = None
) -> StageRecord[Served]:
    """Sweep one build's server over the card's concurrency levels and log it."""
    checkpoint, checkpoint_id = checkpoint_for(card, precision)
    srv, s = card.server, card.speed
    engine = "external" if url else choose_engine(srv.engine)
    load = loadgen.LoadSettings(
        api=srv.api,
        concurrency=s.concurrency,
        requests_per_user=srv.requests_per_user,
        warmup=srv.warmup,
        input_len=s.input_len,
        output_len=s.output_len,
        exact_length=EXACT_LENGTH.get(engine, "none"),
        timeout_s=srv.timeout_s,
    )
    inputs = {
        "checkpoint": checkpoint_id,
        "engine": engine,
        "url": url,
        "load": load.model_dump(),
        "slo": s.slo.model_dump(),
    }

    def work(out: Path) -> Served:
        return _sweep(card, precision, checkpoint, engine, load, url, out)

    code = [Path(loadgen.__file__), Path(serving.__file__), Path(loadgen.__file__).with_name("stream_stub.py"),
            Path(__file__)]  # fmt: skip
    return run_stage(tracker, precision, Served, inputs, code, work, force=force)


def _sweep(
    card: ModelCard,
    precision: str,
    checkpoint: str,
    engine: str,
    load: loadgen.LoadSettings,
    url: str | None,
    out: Path,
) -> Served:
    """Measure the generator's ceiling, then sweep the server (started here unless `url` is given)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=card.source.trust_remote_code)
    prompts = loadgen.synthetic_prompts(tokenizer, 16, load.input_len)
    top = 4 * max(load.concurrency)
    ceiling = generator_ceiling(out, top, 4)
    log.info("load generator ceiling: %.0f chunks/s at concurrency %d", ceiling.chunks_per_s, top)
    slo = serving.Slo(card.speed.slo.ttft_ms, card.speed.slo.tpot_ms)

    def progress(c: int, level: list[serving.RequestRecord]) -> None:
        m = serving.level_metrics(level, slo)
        log.info(
            "%s@%s concurrency %d: %d requests, %d failed, TTFT p50 %.0f ms, TPOT p50 %.1f ms, %.1f tok/s",
            card.name, precision, c, m.requests, m.failed, m.ttft_ms_p50 or float("nan"),
            m.tpot_ms_p50 or float("nan"), m.output_tps or 0.0,
        )  # fmt: skip

    def sweep(base_url: str) -> list[serving.RequestRecord]:
        model = served_model(base_url, checkpoint) if url else checkpoint
        try:
            return loadgen.sweep(loadgen.LoadConfig(url=base_url, model=model, **load.model_dump()), prompts, progress)
        except RuntimeError as e:
            where = f"the server at {url}" if url else f"the server's log {out / 'server.log'}"
            raise QevalError(f"{card.name}@{precision} server: {e}; check {where}") from None

    if url:
        records = sweep(url)
    else:
        cmd = server_command(engine, checkpoint, card.source.trust_remote_code, max_sequences=max(load.concurrency),
                             input_len=load.input_len, output_len=load.output_len)  # fmt: skip
        what = f"{engine} serve for {card.name}@{precision}"
        with running(cmd, out / "server.log", card.server.start_timeout_s, what, offline_env(card)) as base_url:
            records = sweep(base_url)
    serving.write_csv(records, out / "requests.csv")
    return _served(engine, load, card, records, slo, ceiling)


def _served(
    engine: str,
    load: loadgen.LoadSettings,
    card: ModelCard,
    records: list[serving.RequestRecord],
    slo: serving.Slo,
    ceiling: GeneratorCeiling,
) -> Served:
    per_level = serving.sweep_metrics(records, slo)
    peak = max((m.output_tps or 0.0 for m in per_level.values()), default=0.0)
    bound = ceiling.chunks_per_s < 10 * peak
    if bound:
        log.warning(
            "the load generator's ceiling (%.0f chunks/s) is under 10x the server's peak %.0f tokens/s: "
            "its figures may be the generator's", ceiling.chunks_per_s, peak,
        )  # fmt: skip
    return Served(
        engine=engine,
        load=load,
        slo=card.speed.slo,
        per_level=per_level,
        max_users_at_slo=serving.max_users_at_slo(per_level),
        failed_requests=sum(m.failed for m in per_level.values()),
        generator_ceiling=ceiling,
        generator_bound=bound,
    )
