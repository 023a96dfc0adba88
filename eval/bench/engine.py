"""In-process generation benchmark of one build over a (batch, input, output) grid.

Each grid point: `warmup` untimed generations, then `repeats` timed ones of exactly `output_len` new
tokens (greedy, EOS ignored) after a synthetic prompt of exactly `input_len` random token ids. A
streamer timestamps every new token after synchronizing the device, so TTFT (prefill + first token),
inter-token latency, TPOT and end-to-end latency all come from the same clock. Medians and p90s are
reported with the sample count. On CUDA (or when asked) the KV cache is static and the decode step is
compiled (as gpt-fast does); a build that cannot compile runs eager and says why; elsewhere generation
is eager with a dynamic cache. An out-of-memory point is a result ("oom"), not a crash.
The pipeline runs bench_engine() in a fresh process per build (pipelines/core/system/child.py).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from eval.bench.instruments import Clock, RssPeak, measure_copy_bandwidth
from eval.devices import speed
from eval.devices.gpus import peak_bandwidth
from eval.devices.sizing import Shape
from eval.quality.kvcache import fp8_kv_attention
from quant.execution import CPU, DEQUANTIZED, Device, Execution, execution

WARM_IMPORTS = ("torch", "transformers")
"""What every engine bench imports: pipelines/core/system/warm.py imports them once for the builds it benches."""


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(description="build folder; with no_weights, a folder or config.json giving the shape")
    precision: str
    no_weights: bool = Field(False, description="random weights built from the config: speed and memory only")
    batch_sizes: list[int] = Field(min_length=1)
    input_lengths: list[int] = Field(min_length=1)
    output_lengths: list[int] = Field(min_length=1)
    warmup: int = Field(ge=0, description="untimed runs per grid point")
    repeats: int = Field(gt=0, description="timed runs per grid point")
    device: str = Field("auto", description="auto: cuda where available, else cpu")
    dtype: str = "bfloat16"
    compile: bool | None = Field(None, description="static KV cache + torch.compile; None: on CUDA only")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="fp8: keys and values rounded through FP8 before attention reads them (eval/quality/kvcache.py; "
        "emulated: its arithmetic's cost, not a real FP8 cache's speed)",
    )
    bandwidth_gb_s: float | None = Field(None, description="peak memory bandwidth; None: GPU table or measured")
    trust_remote_code: bool = False
    seed: int = 0


class PointResult(BaseModel):
    batch: int
    input_len: int
    output_len: int
    status: str = Field(description="ok, or oom when the point did not fit")
    repeats: int = 0
    ttft_ms_p50: float | None = None
    ttft_ms_p90: float | None = None
    itl_ms_p50: float | None = None
    itl_ms_p90: float | None = None
    tpot_ms_p50: float | None = None
    e2e_ms_p50: float | None = None
    e2e_ms_p90: float | None = None
    decode_tps_per_user: float | None = Field(None, description="1 / median TPOT")
    decode_tps_total: float | None = Field(None, description="per user x batch")
    chars_per_s_total: float | None = Field(None, description="decode_tps_total x characters per token")
    peak_mem_bytes: int | None = None
    mbu: float | None = None
    compile_error: str | None = Field(None, description="why this point ran eager where the build compiled")


class EngineResult(BaseModel):
    precision: str
    device: str
    device_name: str
    engine: str
    dtype: str
    execution: Execution = Field(description="transformers dequantizes every quantized format: emulated")
    no_weights: bool
    weight_bytes: int = Field(description="bytes of parameters and buffers resident on the device")
    embedding_bytes: int = Field(
        description="bytes of the input embedding table, which a decode step indexes (0 where tied to the output)"
    )
    kv_bytes_per_token: int
    bandwidth_gb_s: float
    bandwidth_source: str
    chars_per_token: float | None
    compile_error: str | None = Field(None, description="why torch.compile was asked for but the build ran eager")
    memory: str = Field(description="what peak_mem_bytes measures")
    versions: dict[str, str]
    points: list[PointResult]

    @property
    def kernels(self) -> str:
        """How the products ran, in words."""
        if self.execution == Execution.EMULATED:
            return f"{self.execution} (weights dequantized to {self.dtype})"
        return str(self.execution)


def _load(cfg: EngineConfig, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, cfg.dtype)
    tokenizer = None
    attention = {"attn_implementation": fp8_kv_attention()} if cfg.kv_cache_dtype == "fp8" else {}
    if cfg.no_weights:
        config = AutoConfig.from_pretrained(cfg.checkpoint, trust_remote_code=cfg.trust_remote_code)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **attention
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.checkpoint, dtype=dtype, trust_remote_code=cfg.trust_remote_code, use_safetensors=True, **attention
        ).to(device)
        tokenizer = AutoTokenizer.from_pretrained(cfg.checkpoint)
    return model.eval(), tokenizer


def _resident_bytes(model) -> int:
    """Bytes of parameters and buffers the model holds once it has run: transformers leaves a compressed-tensors
    checkpoint's weights packed when it loads them and decompresses them at the first forward
    (transformers/quantizers/quantizer_compressed_tensors.py, `dequantize=False`), so every forward after
    that reads the 16-bit weights; counted before it, a low-bit build's bytes (and so its MBU) were a fraction
    of what its decode steps read."""
    import torch

    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]], device=model.device))
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _indexed_embedding_bytes(model) -> int:
    """Bytes of the input embedding table, or 0 where the output layer shares it (and reads it whole)."""
    table = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is not None and out.weight.data_ptr() == table.data_ptr():
        return 0
    return table.numel() * table.element_size()


def _chars_per_token(tokenizer) -> float | None:
    if tokenizer is None:
        return None
    from quant.verify import PROMPTS

    text = " ".join(PROMPTS)
    return len(text) / len(tokenizer.encode(text, add_special_tokens=False))


def _compile_config(cuda: bool):
    """Decode-only compilation, as gpt-fast does: generate() runs the prefill eager and compiles the
    one-token step over the static cache (CUDA graphs on CUDA). Compiled for the grid's first shape; the
    first other shape compiles once more with its batch and cache length symbolic (torch's automatic dynamic
    shapes, `dynamic=None`), and that graph serves the rest of the grid, where a graph per shape would compile
    once per grid point."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=None, mode="reduce-overhead" if cuda else "default")
    # generate() compiles by itself only on CUDA-like devices; CompileConfig._compile_all_devices is the
    # flag its auto-compile check reads to do so elsewhere (transformers 5.17, generation/utils.py,
    # _valid_auto_compile_criteria), which is how the compiled path is tested on a CPU.
    config._compile_all_devices = not cuda
    return config


def _decode_setup(model, cfg: EngineConfig, cuda: bool, sync) -> tuple[dict, str, str | None]:
    """generate() arguments for the grid, the engine's label, and why compilation failed if it did.

    Compilation is tried on the grid's first shape (whose graph the grid then reuses); a build whose
    forward dynamo cannot trace (compressed-tensors' packed layers, for one) keeps the static cache,
    runs eager and says why.
    """
    import torch

    if not (cfg.compile if cfg.compile is not None else cuda):
        return {}, "dynamic cache, eager", None
    grid = len(cfg.batch_sizes) * len(cfg.input_lengths) * len(cfg.output_lengths)
    # at most a graph per grid shape, should a shape not fit the dynamic one; past the limit dynamo runs eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, grid + 2)
    compiled = {"cache_implementation": "static", "compile_config": _compile_config(cuda)}
    try:
        _generate(model, cfg, cfg.batch_sizes[0], cfg.input_lengths[0], cfg.output_lengths[0], compiled)
        sync()
    except Exception as e:  # whatever dynamo or inductor raised, the build is measured eager
        torch._dynamo.reset()
        lines = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]
        return {"cache_implementation": "static", "disable_compile": True}, "static cache, eager", reason
    # get_compiled_call() caches the compiled forward as model._compiled_call (transformers 5.17,
    # modeling_utils.py): its absence after a generate() that should have compiled means it ran eager.
    if not hasattr(model, "_compiled_call"):
        return {"cache_implementation": "static"}, "static cache, eager", "generate() does not compile this model"
    return compiled, "static cache, decode compiled", None


def _generate(model, cfg: EngineConfig, batch: int, input_len: int, output_len: int, extra: dict, streamer=None):
    """One greedy generation of exactly `output_len` new tokens after `input_len` random token ids."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(10, model.config.vocab_size, (batch, input_len), generator=gen).to(model.device)
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,  # forced length: EOS may not end a sequence early
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
            **extra,
        )


def _run_point(model, cfg: EngineConfig, batch: int, input_len: int, output_len: int, sync, extra: dict):
    # a compiled decode step compiles again for each new shape: never time the first call
    warmup = max(cfg.warmup, 1) if "compile_config" in extra else cfg.warmup
    runs = []
    for i in range(warmup + cfg.repeats):
        clock = Clock(sync)
        sync()
        t0 = time.perf_counter()
        _generate(model, cfg, batch, input_len, output_len, extra, clock)
        if i >= warmup:
            runs.append((t0, clock.times))
    return runs


@dataclass(frozen=True)
class _Harness:
    """What every grid point of one build is measured with."""

    model: object
    cfg: EngineConfig
    cuda: bool
    sync: Callable[[], None]
    generate_args: dict
    weight_bytes: int
    embedding_bytes: int
    kv_bytes_per_token: int
    bandwidth: float  # bytes/s
    chars_per_token: float | None


def bench_engine(cfg: EngineConfig, out_dir: Path) -> EngineResult:
    """Benchmark one build over the grid; write grid.csv to `out_dir`."""
    import torch

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, tokenizer = _load(cfg, device)
    kv_token = Shape.from_config(model.config.to_dict()).kv_bytes_per_token(
        torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    )
    weight_bytes = _resident_bytes(model)
    embedding_bytes = _indexed_embedding_bytes(model)
    if cfg.bandwidth_gb_s:
        bandwidth, source = cfg.bandwidth_gb_s * 1e9, "given"
    elif cuda and peak_bandwidth(torch.cuda.get_device_name()):
        bandwidth, source = peak_bandwidth(torch.cuda.get_device_name()), "data sheet"
    else:
        bandwidth, source = measure_copy_bandwidth(device, sync), "measured (memory copy, best of 5)"
    extra, engine, compile_error = _decode_setup(model, cfg, cuda, sync)
    h = _Harness(
        model, cfg, cuda, sync, extra, weight_bytes, embedding_bytes, kv_token, bandwidth, _chars_per_token(tokenizer)
    )
    where = Device("cuda", torch.cuda.get_device_capability()) if cuda else CPU
    grid = itertools.product(cfg.batch_sizes, cfg.input_lengths, cfg.output_lengths)
    result = EngineResult(
        precision=cfg.precision,
        device=device,
        device_name=torch.cuda.get_device_name()
        if cuda
        else f"{platform.processor() or 'cpu'} x{torch.get_num_threads()}",
        engine=f"transformers generate, {engine}" + (", FP8 KV cache emulated" if cfg.kv_cache_dtype == "fp8" else ""),
        compile_error=compile_error,
        dtype=cfg.dtype,
        execution=execution(cfg.precision, where, DEQUANTIZED),
        no_weights=cfg.no_weights,
        weight_bytes=weight_bytes,
        embedding_bytes=embedding_bytes,
        kv_bytes_per_token=kv_token,
        bandwidth_gb_s=bandwidth / 1e9,
        bandwidth_source=source,
        chars_per_token=h.chars_per_token,
        memory="peak CUDA memory allocated" if cuda else "peak resident memory of the process",
        versions={p: metadata.version(p) for p in ("torch", "transformers")},
        points=[_point(h, b, i, o) for b, i, o in grid],
    )
    _write_csv(out_dir / "grid.csv", result)
    return result


def _point(h: _Harness, b: int, i: int, o: int) -> PointResult:
    """One grid point: its timed runs, or `oom` when it does not fit. A compiled build whose graph fails at this
    point (a compile error at a shape the first did not meet) measures the point eager and says why, rather
    than losing the grid."""
    import torch

    try:
        return _measure(h, b, i, o)
    except (torch.cuda.OutOfMemoryError, MemoryError):
        return PointResult(batch=b, input_len=i, output_len=o, status="oom")
    except Exception as e:  # whatever dynamo or inductor raised at this shape
        if "compile_config" not in h.generate_args:
            raise
        torch._dynamo.reset()
        eager = dataclasses.replace(h, generate_args={"cache_implementation": "static", "disable_compile": True})
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]
        return _point(eager, b, i, o).model_copy(update={"compile_error": why})


def _measure(h: _Harness, b: int, i: int, o: int) -> PointResult:
    import torch

    if h.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        runs = _run_point(h.model, h.cfg, b, i, o, h.sync, h.generate_args)
        peak = torch.cuda.max_memory_allocated()
    else:
        # the peak in a run of its own: the sampler's thread, waking every 2 ms, costs a small model's decode
        # a few per cent on 2 cores (docs/measurement.md, "How speed is measured"), so no timed run carries it
        with RssPeak() as rss:
            _generate(h.model, h.cfg, b, i, o, h.generate_args)
        peak = rss.peak
        runs = _run_point(h.model, h.cfg, b, i, o, h.sync, h.generate_args)
    ttft = [(times[0] - t0) * 1e3 for t0, times in runs]
    e2e = [(times[-1] - t0) * 1e3 for t0, times in runs]
    itl = [(t1 - t0) * 1e3 for _, times in runs for t0, t1 in itertools.pairwise(times)]
    tpot = statistics.median(speed.tpot_s(a / 1e3, z / 1e3, o) for a, z in zip(ttft, e2e, strict=True)) * 1e3
    per_user = 1e3 / tpot if o > 1 else None
    context = speed.mid_generation_context(i, o)
    step_bytes = speed.decode_step_bytes(h.weight_bytes, h.embedding_bytes, h.kv_bytes_per_token, b, context)
    return PointResult(
        batch=b,
        input_len=i,
        output_len=o,
        status="ok",
        repeats=len(runs),
        ttft_ms_p50=speed.percentile(ttft, 50),
        ttft_ms_p90=speed.percentile(ttft, 90),
        itl_ms_p50=speed.percentile(itl, 50) if itl else None,
        itl_ms_p90=speed.percentile(itl, 90) if itl else None,
        tpot_ms_p50=tpot if o > 1 else None,
        e2e_ms_p50=speed.percentile(e2e, 50),
        e2e_ms_p90=speed.percentile(e2e, 90),
        decode_tps_per_user=per_user,
        decode_tps_total=per_user * b if per_user else None,
        chars_per_s_total=per_user * b * h.chars_per_token if per_user and h.chars_per_token else None,
        peak_mem_bytes=peak,
        mbu=speed.mbu(step_bytes, per_user, h.bandwidth) if per_user else None,
    )


def _write_csv(path: Path, result: EngineResult) -> None:
    fields = list(PointResult.model_fields)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["precision", "device", "kernels", *fields])
        w.writeheader()
        for p in result.points:
            w.writerow(
                {"precision": result.precision, "device": result.device, "kernels": result.kernels, **p.model_dump()}
            )
