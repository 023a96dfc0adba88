"""The shape stage: one precision's speed at the model's real shape, with random weights, on vLLM.

For a card whose weights cannot be had here (or that asks for it, `qeval shape`), each precision gets a
shape build (quant/shape_build.py: the model's config.json with that precision's own quantization_config, no
weights) that vLLM serves with its dummy loader and no tokenizer; the load generator sends random token ids
of exactly each scenario's input length, forces its output length, and checks both on every request
(sweep.py); every scenario of the card (chat, RAG, ...) is swept in turn on the build's one server.
vLLM picks its kernels as for a real checkpoint, and the stage records which. A build that a short probe at
one user shows to be far outside the objective (FP8 emulated on a CPU: seconds per token) is recorded with
the probe's figures as holding no users, and not swept, so that no level runs for hours. Every figure is
labelled as random weights at the model's shape, logged under `shape/*`, apart from a real checkpoint's
`server/*`.

Beside the sweep, decode at one user is set against the device's bandwidth ceiling for the bytes a decode
step of that format reads (eval/devices/speed.py), which the size stage states beside its projections.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import eval.devices.sizing as sizing
import eval.load.loadgen as loadgen
import eval.load.serving as serving
from eval.bench.instruments import measure_copy_bandwidth
from eval.devices.gpus import peak_bandwidth
from eval.devices.speed import decode_step_bytes, mid_generation_context
from pipelines.core.card.cards import ModelCard, Slo
from pipelines.core.framework.demands import available_bytes, check_sweep
from pipelines.core.framework.runner import run_stage
from pipelines.core.framework.tracker import Tracker
from pipelines.core.framework.weights import architecture_config
from pipelines.core.store.manifests import StageRecord
from pipelines.core.store.results import AtShape, DecodeCeiling, GeneratorCeiling, Probe, ScenarioSweep, VllmSettings
from pipelines.core.system.device import compute_device
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import file_digest
from pipelines.core.system.paths import resolve_repo_path, shown_path
from pipelines.core.system.procs import running
from pipelines.stages import engines, sweep
from quant.execution import Execution
from quant.precisions import kv_cache_dtype
from quant.recipes import RecipeOptions
from quant.shape_build import has_tokenizer, quantization_config, write_shape_build

log = logging.getLogger(__name__)
PROBE_TOKENS = 4
"""Output tokens of each probe request (three gaps give its TPOT)."""
PROBE_MARGIN = 4.0
"""A build whose probe at one user is beyond this multiple of the SLO's TTFT or TPOT is not swept: it cannot
meet the objective at any load, and its levels would take hours. A build slower than the objective by less
is still swept, so that its speed-up over the baseline is measured at every level."""
PROBE_TIMEOUT_S = 300.0


def label_of(card: ModelCard) -> str:
    """What every figure of the stage is: random weights at the shape of the card's model."""
    return f"random weights at the shape of {card.source.hub_id or card.name}"


def context_for(card: ModelCard, positions: int | None) -> int:
    """vLLM's context per sequence: the card's, else what the scenarios need (the longest prompt and output),
    within the model's positions; never the whole context of a long-context model, whose KV cache for one
    sequence could take the cache space the batch needs."""
    if card.server.max_model_len:
        return card.server.max_model_len
    needed = max(sc.input_len + sc.output_len for sc, _ in card.scenarios_within(positions).values()) + 8
    return min(needed, positions) if positions else needed


def _special_ids(arch: dict) -> list[int]:
    ids = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = arch.get(key)
        ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return ids


def device_label(device: str, device_name: str | None) -> str:
    return device_name if device == "cuda" and device_name else f"a CPU with {os.cpu_count()} cores"


def _bandwidth(device: str, device_name: str | None) -> tuple[float, str]:
    """The device's bandwidth ceiling in bytes/s, and where it came from."""
    if device == "cuda" and device_name and (peak := peak_bandwidth(device_name)):
        return peak, "data sheet"
    return measure_copy_bandwidth(megabytes=512, repeats=10), "measured (512 MB memory copy, best of 10)"


def decode_ceiling(
    shape: sizing.Shape,
    precision: str,
    group_size: int,
    kv_dtype_bytes: int,
    load: loadgen.LoadSettings,
    bandwidth: tuple[float, str],
    tpot_ms: float | None,
    device: str,
) -> DecodeCeiling:
    """Measured decode at one user over the ceiling that bandwidth sets for the bytes a step reads, at
    mid-generation of `load`'s lengths."""
    weights = sizing.weight_bytes(shape, precision, group_size)
    context = mid_generation_context(load.input_len, load.output_len)
    step = decode_step_bytes(weights, shape.embedding_table_bytes, shape.kv_bytes_per_token(kv_dtype_bytes), 1, context)
    ceiling = bandwidth[0] / step
    measured = 1000 / tpot_ms if tpot_ms else None
    return DecodeCeiling(
        device=device,
        step_bytes=step,
        bandwidth_gb_s=bandwidth[0] / 1e9,
        bandwidth_source=bandwidth[1],
        ceiling_tps=ceiling,
        measured_tps=measured,
        measured_over_ceiling=measured / ceiling if measured else None,
    )


def probe_verdict(record: serving.RequestRecord, slo: serving.Slo) -> Probe:
    """Whether one warm request at one user puts the build far outside the objective."""
    ttft = 1000 * record.ttft if record.ok and record.ttft is not None else None
    tpot = 1000 * record.tpot if record.ok and record.tpot is not None else None
    if ttft is None:
        return Probe(
            output_len=record.output_tokens,
            ttft_ms=None,
            tpot_ms=None,
            too_slow=True,
            why=f"the probe request failed ({record.error or 'no tokens'})",
        )
    over = []
    if ttft > PROBE_MARGIN * slo.ttft_ms:
        over.append(f"TTFT {ttft:.0f} ms > {PROBE_MARGIN:g} x {slo.ttft_ms:g} ms")
    if tpot is not None and tpot > PROBE_MARGIN * slo.tpot_ms:
        over.append(f"TPOT {tpot:.0f} ms > {PROBE_MARGIN:g} x {slo.tpot_ms:g} ms")
    why = (
        ("at one user " + " and ".join(over) + ": holds no users within the objective; not swept")
        if over
        else ("near enough the objective at one user to sweep")
    )
    return Probe(output_len=record.output_tokens, ttft_ms=ttft, tpot_ms=tpot, too_slow=bool(over), why=why)


def shape(card: ModelCard, precision: str, tracker: Tracker, *, force: bool = False) -> StageRecord[AtShape]:
    """Sweep one precision's shape build on vLLM with random weights, and log it."""
    card.require_precision(precision)
    check_sweep(card)
    config = architecture_config(card, "the shape stage (speed at the model's shape)")
    arch = json.loads(config.read_text())
    vllm = engines.find_vllm()
    if vllm is None:
        raise QevalError(
            f"model '{card.name}': the shape stage serves on vLLM and none is installed here; "
            f"make it with `make engine` (.venv-vllm) or set QEVAL_VLLM_PYTHON"
        )
    device, device_name = engines.this_device()
    srv, s = card.server, card.speed
    opts = RecipeOptions(group_size=card.quantization.group_size, ignore=list(card.quantization.ignore))
    positions = arch.get("max_position_embeddings")
    kv, length = kv_cache_dtype(precision, srv.kv_cache_dtype), context_for(card, positions)
    share, small = (
        engines.gpu_memory_plan(
            arch, sizing.KV_DTYPE_BYTES[kv], max(s.concurrency), length, compute_device().memory_bytes
        )
        if device.kind == "cuda"
        else (0.9, False)
    )
    settings = VllmSettings(
        device=device.kind,
        max_model_len=length,
        tensor_parallel=srv.tensor_parallel or 1,
        pipeline_parallel=srv.pipeline_parallel,
        kv_cache_dtype=kv,
        enforce_eager=(device.kind == "cpu" or small) if srv.enforce_eager is None else srv.enforce_eager,
        gpu_memory_utilization=share,
        cpu_kv_cache_gb=engines.cpu_kv_space_gb(arch, sizing.KV_DTYPE_BYTES[kv], length, srv.cpu_kv_cache_gb),
        random_weights=True,
        dtype=engines.vllm_dtype(device),  # as the serve stage computes here: float32 where bf16 would be emulated
        torch_onednn=not engines.torch_onednn_off(precision, device),
    )
    points = _loads(card, positions)
    cannot = engines.vllm_cannot_run(precision, device, dtype=settings.dtype) or engines.kv_cannot_serve(
        settings.kv_cache_dtype, "vllm", device
    )
    if device.kind == "cpu" and not cannot:
        group, kv_gb = card.quantization.group_size, settings.cpu_kv_cache_gb
        cannot = engines.cpu_memory_short(arch, precision, group, settings.dtype, kv_gb, available_bytes())
    version = f"{vllm.distribution} {vllm.version}"
    inputs = {
        "config": file_digest([config]),
        "quantization_config": quantization_config(precision, opts),
        "engine_version": version,
        "vllm": settings.model_dump(),
        "scenarios": {
            name: {"load": load.model_dump(), "slo": slo.model_dump()} for name, (load, slo, _) in points.items()
        },
        "probe": [PROBE_TOKENS, PROBE_MARGIN, PROBE_TIMEOUT_S],
        "cannot_run": cannot,  # this CPU's instruction sets, which environment()'s device does not say
    }
    label = f"{card.name}@{precision} ({label_of(card)})"

    def work(out: Path) -> AtShape:
        local = resolve_repo_path(card.source.path) if card.source.path else None
        build = write_shape_build(
            config, precision, opts, out / "build", local if local and has_tokenizer(local) else None
        )
        bandwidth = _bandwidth(device.kind, device_name)
        top = 4 * max(s.concurrency)
        ceiling = sweep.generator_ceiling(out, top, 4)
        where = f"its log {out / 'server.log'}"
        swept: dict[str, tuple[Probe, list[serving.RequestRecord], sweep.Seen]] = {}
        if cannot:
            # recorded as holding no users, with the reason, as a build too slow to sweep is; not started
            log.warning("%s: %s; not run", label, cannot)
            probe = Probe(output_len=0, ttft_ms=None, tpot_ms=None, too_slow=True, why=f"{cannot}; not run")
            swept = {name: (probe, [], sweep.Seen()) for name in points}
            kernels, how = [], Execution.UNKNOWN
        else:
            cmd, env = engines.vllm_command(vllm.python, str(build), settings, trust_remote_code=False)
            log.info("starting vLLM for %s (log: %s)", label, out / "server.log")
            with running(
                cmd,
                out / "server.log",
                srv.start_timeout_s,
                f"vLLM for {label}",
                env,
                sweep.SERVER_NICE,
                on_gpu=device.kind == "cuda",  # the next build's vLLM starts once this one's memory is back
            ) as base:
                for name, (load, objective, capped) in points.items():
                    if capped:
                        log.info("%s, scenario %s: %s", label, name, capped)
                    room = engines.kv_room(
                        (out / "server.log").read_text(errors="replace"), load.input_len + load.output_len
                    )
                    swept[name] = _scenario(
                        f"{label}, scenario {name}", base, str(build), arch, load, objective, where, room, ceiling
                    )
                    sweep.check_alive(label, base, swept[name][1], out, where)
            kernels, how = sweep.vllm_kernels(label, out / "server.log", precision, device)
        scenarios = {}
        for name, (probe, records, seen) in swept.items():
            load, objective, capped = points[name]
            serving.write_csv(records, out / f"requests-{name}.csv")
            summary = sweep.levels_summary(records, serving.Slo(objective.ttft_ms, objective.tpot_ms), ceiling, seen)
            one = summary["per_level"].get(1)
            tpot = one.tpot_ms_p50 if one and one.tpot_ms_p50 else probe.tpot_ms
            at = decode_ceiling(
                sizing.Shape.from_config(arch),
                precision,
                card.quantization.group_size,
                sizing.KV_DTYPE_BYTES[settings.kv_cache_dtype],
                load,
                bandwidth,
                tpot,
                device_label(device.kind, device_name),
            )
            if at.measured_over_ceiling is not None:
                log.info(
                    "%s, scenario %s: decode at one user %.1f tokens/s, %.0f%% of the %.1f tokens/s that "
                    "%.1f GB/s allows",
                    label,
                    name,
                    at.measured_tps,
                    100 * at.measured_over_ceiling,
                    at.ceiling_tps,
                    at.bandwidth_gb_s,
                )
            scenarios[name] = ScenarioSweep(
                load=load, slo=objective, capped=capped, probe=probe if probe.too_slow else None, ceiling=at, **summary
            )
        return AtShape(
            engine_version=version,
            vllm=settings,
            device_name=device_name if device.kind == "cuda" else None,
            kernels=kernels,
            execution=how,
            weights=label_of(card),
            shape_config=shown_path(config),
            generator_ceiling=ceiling,
            scenarios=scenarios,
        )

    return run_stage(tracker, precision, AtShape, inputs, work, force=force)


def _loads(card: ModelCard, positions: int | None) -> dict[str, tuple[loadgen.LoadSettings, Slo, str | None]]:
    """Per scenario, within the model's context: the load generator's settings, its objective, how it was cut."""
    srv, s = card.server, card.speed
    common = {
        "api": "completions",
        "concurrency": s.concurrency,
        "requests_per_user": srv.requests_per_user,
        "warmup": srv.warmup,
        "exact_length": "ignore_eos",
        "timeout_s": srv.timeout_s,
        "edge": srv.edge,
    }
    return {
        name: (loadgen.LoadSettings(**common, input_len=sc.input_len, output_len=sc.output_len), s.slo_of(sc), capped)
        for name, (sc, capped) in card.scenarios_within(positions).items()
    }


def _scenario(
    label: str,
    base: str,
    model: str,
    arch: dict,
    load: loadgen.LoadSettings,
    objective: Slo,
    where: str,
    room: int | None,
    ceiling: GeneratorCeiling,
) -> tuple[Probe, list[serving.RequestRecord], sweep.Seen]:
    """One scenario on the running server: the probe, then the levels (past the grid toward the objective's edge,
    as the serve stage's: eval/load/edge.py) unless the probe found it too slow."""
    prompts = loadgen.token_prompts(
        int(arch["vocab_size"]), loadgen.prompts_needed(load) + 2, load.input_len, avoid=_special_ids(arch)
    )
    slo = serving.Slo(objective.ttft_ms, objective.tpot_ms)
    probe = _probe(label, base, model, load, prompts[-2:], slo, where)
    log.info(
        "%s: probe at one user: TTFT %s ms, TPOT %s ms: %s", label, _ms(probe.ttft_ms), _ms(probe.tpot_ms), probe.why
    )
    seen = sweep.Seen()
    if probe.too_slow:
        return probe, [], seen
    return (
        probe,
        sweep.run_levels(label, base, model, load, prompts, slo, where, seen, room=room, ceiling=ceiling),
        seen,
    )


def _probe(
    label: str, base: str, model: str, load: loadgen.LoadSettings, prompts: list, slo: serving.Slo, where: str
) -> Probe:
    """Two requests at one user (the first warms the server), PROBE_TOKENS out each; the second decides."""
    short = load.model_copy(
        update={
            "concurrency": [1],
            "requests_per_user": 2,
            "warmup": 0,
            "output_len": PROBE_TOKENS,
            "timeout_s": PROBE_TIMEOUT_S,
            "edge": None,
        }
    )
    records = sweep.run_levels(f"{label} probe", base, model, short, prompts, slo, where)
    return probe_verdict(records[-1], slo)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
