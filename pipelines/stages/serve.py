"""The serve stage: a real OpenAI-compatible server per build, swept over concurrency under the card's SLO,
and where the card asks, the build's accuracy as that server scores it (served_accuracy.py).

The server is vLLM wherever it is installed (card `server.engine: auto`; engines.py), else
`transformers serve --continuous-batching`, or one the user runs (`--url`). It binds a free port on
127.0.0.1, its log is kept, and it is stopped with everything it started on every way out. Which linear
kernel vLLM chose for each quantized layer type is read from its log and says how the figures ran
(quant/execution.py). The sweep itself is sweep.py's: the load generator (eval/load/loadgen.py) measures its own
ceiling against a minimal local streaming endpoint in the same stage, so that a slow generator cannot pass
for a slow server, and every request's realised lengths are checked. A KV-cache variant (`int8+kv-fp8`) is
served with its own `--kv-cache-dtype`; where no engine here can keep that cache (vLLM's CPU attention
without AVX-512), it is recorded as not served, with the reason, and holds no users.
"""

from __future__ import annotations

import logging
from pathlib import Path

import eval.load.loadgen as loadgen
import eval.load.serving as serving
from eval.devices.gpus import get_gpu, gpu_for_device
from eval.devices.sizing import KV_DTYPE_BYTES
from eval.quality.accuracy import AccuracyConfig
from pipelines.core.card.cards import ModelCard, Server
from pipelines.core.framework.demands import check_sweep
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import checkpoint_for, model_config, model_positions, offline_env
from pipelines.core.store.manifests import StageRecord, result_of
from pipelines.core.store.results import Served, ServedAccuracy, Sized, VllmSettings
from pipelines.core.system.device import compute_device
from pipelines.core.system.errors import QevalError
from pipelines.core.system.net import json_or, redact
from pipelines.core.system.procs import running
from pipelines.stages import engines, served_accuracy, sweep
from quant.execution import Device, Execution
from quant.precisions import kv_cache_dtype

log = logging.getLogger(__name__)
EXACT_LENGTH = {"vllm": "ignore_eos", "transformers": "generation_config"}  # how each engine is held to a length
WARMUP_LOAD_S = 300.0  # a first request that loads the model (transformers serve loads at its first request)


def warmup_timeout(srv: Server, engine: str) -> float:
    """How long the first warm-up request may take: the card's bound, else long enough for a server qeval
    started to load the model at it, or the card's per-request bound for a server the user runs (`--url`)."""
    if srv.warmup_timeout_s is not None:
        return srv.warmup_timeout_s
    return srv.timeout_s if engine == "external" else WARMUP_LOAD_S


def served_model(url: str, default: str) -> str:
    """The first model a running server lists at /v1/models (the name it expects), else `default`."""
    listed = json_or(url.rstrip("/") + "/v1/models", {})
    models = listed.get("data") if isinstance(listed, dict) else None
    try:
        return models[0]["id"] if models else default
    except (KeyError, TypeError, IndexError):
        return default


def default_tensor_parallel(card: ModelCard, sized: Sized | None, device_name: str | None) -> int:
    """The card's degree, else the GPUs the size stage says the build needs on the GPU in use (or the
    card's first target GPU where this one is not in the catalog); 1 where nothing says otherwise."""
    if card.server.tensor_parallel:
        return card.server.tensor_parallel
    if sized is None:
        return 1
    here = gpu_for_device(device_name) if device_name else None
    name = here.name if here else (card.target_gpus[0] if card.target_gpus else None)
    fit = next((f for f in sized.fits if f.gpu == name), None)
    if fit is None:
        return 1
    if fit.tensor_parallel is None:
        raise QevalError(
            f"{card.name}: the size stage says a build does not fit 8 x {get_gpu(name).name}; "
            f"set server.tensor_parallel and pipeline_parallel in the card"
        )
    return fit.tensor_parallel


def vllm_settings(
    card: ModelCard,
    precision: str,
    checkpoint: str,
    device: Device,
    device_name: str | None = None,
    gpu_memory: int | None = None,
) -> VllmSettings:
    """How vLLM serves this build here: the card's settings, with the defaults filled in.

    Served accuracy needs two tokens beyond the offline evaluation's context window (eval/quality/accuracy.py,
    _served_args); where that passes the model's positions, the extra ones are never scored
    (engines.vllm_command extends vLLM's position table to them). On a GPU, a model too small to fill one is
    served eager in a share of it sized to the sweep (engines.gpu_memory_plan).
    vLLM computes in the dtype the offline evaluation does (quant.execution.compute_dtype), so that served
    and offline scores differ by the engines alone: the checkpoint's bf16 on a GPU and a CPU with bf16 units,
    float32 on another CPU, where bf16 is emulated and slower (docs/toolchain.md, "transformers").
    """
    srv = card.server
    positions = model_positions(checkpoint) or srv.max_model_len or 2048
    length = srv.max_model_len or positions
    if srv.served_accuracy:
        length = max(length, (card.context_window(positions) or positions) + 2)
    gpu = device.kind == "cuda"
    sized = result_of(card.name, precision, Sized) if gpu else None
    kv = kv_cache_dtype(precision, srv.kv_cache_dtype)
    share, small = (
        engines.gpu_memory_plan(
            model_config(checkpoint), KV_DTYPE_BYTES[kv], max(card.speed.concurrency), length, gpu_memory
        )
        if gpu
        else (0.9, False)
    )
    return VllmSettings(
        device=device.kind,
        max_model_len=length,
        tensor_parallel=default_tensor_parallel(card, sized, device_name) if gpu else 1,
        pipeline_parallel=srv.pipeline_parallel,
        kv_cache_dtype=kv,
        enforce_eager=(not gpu or small) if srv.enforce_eager is None else srv.enforce_eager,
        gpu_memory_utilization=share,
        cpu_kv_cache_gb=engines.cpu_kv_space_gb(
            model_config(checkpoint), KV_DTYPE_BYTES[kv], length, srv.cpu_kv_cache_gb
        ),
        positions=positions if length > positions else None,
        dtype=engines.vllm_dtype(device),
        torch_onednn=not engines.torch_onednn_off(precision, device),
    )


def serve(
    card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False, url: str | None = None
) -> StageRecord[Served]:
    """Sweep one build's server over the card's concurrency levels (and score it, where asked) and log it."""
    check_sweep(card)  # the grid against the model's lengths and this machine, before anything starts
    checkpoint, checkpoint_id = checkpoint_for(card, precision)
    srv, s = card.server, card.speed
    name = s.main_scenario[0]
    scenario, capped = card.scenarios_within(model_positions(checkpoint))[name]
    if capped:
        log.info("%s@%s, scenario %s: %s", card.name, precision, name, capped)
    engine = "external" if url else engines.choose_engine(srv.engine)
    if url and srv.starts > 1:
        log.warning(
            "%s: server.starts is %d, but the server at %s is not qeval's to start again: one sweep",
            card.name,
            srv.starts,
            url,
        )
    device, device_name = engines.this_device()
    fallback = (
        engines.vllm_cannot_run(precision, device, dtype=engines.vllm_dtype(device)) if engine == "vllm" else None
    )
    if fallback:
        log.warning(
            "%s@%s: %s; served by transformers serve instead (weights dequantized: emulated)",
            card.name,
            precision,
            fallback,
        )
        engine = "transformers"
    load = loadgen.LoadSettings(
        api=srv.api,
        concurrency=s.concurrency,
        requests_per_user=srv.requests_per_user,
        edge=srv.edge,
        warmup=srv.warmup,
        input_len=scenario.input_len,
        output_len=scenario.output_len,
        exact_length=EXACT_LENGTH.get(engine, "none"),
        timeout_s=srv.timeout_s,
        warmup_timeout_s=warmup_timeout(srv, engine),
    )
    kv = kv_cache_dtype(precision, srv.kv_cache_dtype)
    if unserved := engines.kv_cannot_serve(kv, engine, device):
        why = f"{fallback}, and {unserved}" if fallback else unserved
        return _not_served(
            card,
            precision,
            tracker,
            {"checkpoint": checkpoint_id, "engine": engine, "load": load.model_dump(), "kv_cache_dtype": kv},
            load,
            why,
            force,
        )
    vllm, settings = None, None
    if engine == "vllm":
        vllm = engines.find_vllm()
        if vllm is None:
            raise QevalError(
                f"model '{card.name}': server.engine is vllm but no vLLM is installed here; "
                f"make it with `make engine` (.venv-vllm) or set QEVAL_VLLM_PYTHON"
            )
        settings = vllm_settings(card, precision, checkpoint, device, device_name, compute_device().memory_bytes)
    scored, offline = served_accuracy.plan(card, precision, checkpoint, engine)
    version = f"{vllm.distribution} {vllm.version}" if vllm else None
    inputs = {
        "checkpoint": checkpoint_id,
        "engine": engine,
        "engine_version": version,
        "vllm": settings.model_dump() if settings else None,
        "url": redact(url) if url else None,  # a password in the address is not recorded
        "load": load.model_dump(),
        # a server the user runs is not qeval's to start again; one start adds nothing to the key
        **({"starts": srv.starts} if srv.starts > 1 and not url else {}),
        "slo": s.slo_of(scenario).model_dump(),
        "served_accuracy": scored.model_dump(mode="json", exclude={"checkpoint", "include_path"}) if scored else None,
        "offline": offline.inputs_digest if offline else None,
    }

    def work(out: Path) -> Served:
        if url:
            launch = None
        elif vllm is not None and settings is not None:
            launch = engines.vllm_command(vllm.python, checkpoint, settings, card.source.trust_remote_code)
        else:
            launch = _transformers(card, checkpoint, load, device), {}
        served = _sweep(card, precision, checkpoint, engine, device, settings, load, url, launch, scored, out)
        missed = served_accuracy.not_run(engine) if card.server.served_accuracy and scored is None else None
        here = None if url or device.kind == "cpu" else device_name
        served = served.model_copy(update={"engine_version": version, "not_run": missed, "device_name": here})
        if served.accuracy is not None and offline is not None:
            scored_now = served_accuracy.against_offline(card, precision, served.accuracy, offline, out)
            served = served.model_copy(update={"accuracy": scored_now})
        return served

    return run_stage(tracker, precision, Served, inputs, work, force=force)


def _not_served(
    card: ModelCard, precision: str, tracker: Tracker, inputs: dict, load: loadgen.LoadSettings, why: str, force: bool
) -> StageRecord[Served]:
    """A build no engine here can serve as it ships: recorded with the reason, holding no users, nothing swept
    or scored (its offline evaluation and its sizing stand)."""

    def work(out: Path) -> Served:
        log.warning("%s@%s: %s; not served, swept or scored here", card.name, precision, why)
        ceiling = sweep.generator_ceiling(out, 4 * max(load.concurrency), 4)
        return Served(
            engine=inputs["engine"],
            execution=Execution.UNKNOWN,
            load=load,
            slo=card.speed.main_slo,
            per_level={},
            max_users_at_slo=0,
            failed_requests=0,
            generator_ceiling=ceiling,
            generator_bound=False,
            not_run=f"{why}: not served, swept or scored here",
        )

    return run_stage(tracker, precision, Served, {**inputs, "not_served": why}, work, force=force)


def _sweep(
    card: ModelCard,
    precision: str,
    checkpoint: str,
    engine: str,
    device: Device,
    settings: VllmSettings | None,
    load: loadgen.LoadSettings,
    url: str | None,
    launch: tuple[list[str], dict[str, str]] | None,
    scored: AccuracyConfig | None,
    out: Path,
) -> Served:
    """Measure the generator's ceiling, then sweep the server (started here with `launch`, the command and
    its environment, unless `url` is given), and score it with lm-eval where `scored` says how."""
    from transformers import AutoTokenizer

    label = f"{card.name}@{precision}"
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=card.source.trust_remote_code)
    texts = loadgen.synthetic_prompts(tokenizer, loadgen.prompts_needed(load), load.input_len)
    # vLLM takes the prompts as token ids: exactly input_len of them, with no special token of its own added
    # (a tokenizer that adds BOS would make every prompt one longer than asked, and the length check fail)
    ids = engine == "vllm" and load.api == "completions"
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts] if ids else texts
    top = 4 * max(load.concurrency)
    ceiling = sweep.generator_ceiling(out, top, 4)
    log.info("load generator ceiling: %.0f chunks/s at concurrency %d", ceiling.chunks_per_s, top)
    objective = card.speed.main_slo
    slo = serving.Slo(objective.ttft_ms, objective.tpot_ms)
    where = f"the server at {redact(url)}" if url else f"its log {out / 'server.log'}"

    scores: ServedAccuracy | None = None
    seen = sweep.Seen()  # the server's own view of each level, where it exports vLLM's metrics; their sizing
    if launch is None:
        model = served_model(url or "", checkpoint)
        records = sweep.run_levels(label, url or "", model, load, prompts, slo, where, seen, ceiling=ceiling)
        sweep.check_alive(label, url or "", records, out, where)
    else:
        cmd, env = launch
        what = f"{engine} serve for {label}"

        def start(server_log: Path):
            env_all = {**offline_env(card), **env}
            on_gpu = compute_device().kind == "cuda"  # the next build's server starts once its memory is back
            return running(
                cmd, server_log, card.server.start_timeout_s, what, env_all, sweep.SERVER_NICE, on_gpu=on_gpu
            )

        log.info("starting %s (log: %s)", what, out / "server.log")
        with start(out / "server.log") as base:
            room = _room(engine, load, out / "server.log")
            records = sweep.run_levels(
                label, base, checkpoint, load, prompts, slo, where, seen, room=room, ceiling=ceiling
            )
            sweep.check_alive(label, base, records, out, where)
            if scored is not None:
                log.info("%s: lm-eval %s against the server", label, ", ".join(scored.tasks))
                scores = served_accuracy.score(card, scored, base, out)
        if card.server.starts > 1:
            records = sweep.more_starts(label, card.server.starts, start, checkpoint, load, prompts, slo, out, records)
    serving.write_csv(records, out / "requests.csv")
    served = Served(
        engine=engine,
        execution=Execution.UNKNOWN,
        load=load,
        starts=len({r.run for r in records}) or 1,
        slo=objective,
        generator_ceiling=ceiling,
        **sweep.levels_summary(records, slo, ceiling, seen),
    )
    if settings is not None:
        kernels, how = sweep.vllm_kernels(label, out / "server.log", precision, device)
        served = served.model_copy(update={"vllm": settings, "kernels": kernels, "execution": how})
    elif engine == "transformers":
        served = served.model_copy(update={"execution": engines.transformers_execution(precision, device)})
    return served.model_copy(update={"accuracy": scores})


def _room(engine: str, load: loadgen.LoadSettings, server_log: Path) -> int | None:
    """The sequences of the sweep's lengths the server qeval started can hold at once: vLLM's KV cache as its log
    says, the sequences transformers serve was sized for (_transformers)."""
    if engine == "vllm":
        return engines.kv_room(server_log.read_text(errors="replace"), load.input_len + load.output_len)
    return _sequences(load)


def _sequences(load: loadgen.LoadSettings) -> int:
    """The sequences transformers serve's cache is sized for: the grid's top, or as far as the edge search may
    raise the load past it."""
    return max(*load.concurrency, load.edge.max_users if load.edge else 0)


def _transformers(card: ModelCard, checkpoint: str, load: loadgen.LoadSettings, device: Device) -> list[str]:
    return engines.transformers_command(
        checkpoint,
        card.source.trust_remote_code,
        device=device.kind,
        max_sequences=_sequences(load),
        batch_sequences=max(load.concurrency),
        input_len=load.input_len,
        output_len=load.output_len,
    )
