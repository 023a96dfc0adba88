"""Sizing: memory and speed projections per precision and GPU, from a model's config (pure functions).

Memory on a GPU = weights + KV cache (batch x context tokens) + activation workspace + runtime reserve,
against the GPU's memory times the fraction a server may use. Weights come from the build's real
bytes where a checkpoint exists, else from the config and the precision's bytes per weight (scales
and zero points included; embeddings and lm_head stay 16-bit, as qeval builds them). Decode is
bandwidth-bound: tokens/s per sequence <= bandwidth x MBU / bytes read per step (eval/devices/speed.py's
decode_step_bytes: every weight but the embedding table, which is only indexed, plus each sequence's KV
cache at the mid-generation context). Prefill is compute-bound:
TTFT >= 2 x parameters x prompt tokens (+ attention) / (peak FLOP/s x MFU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eval.devices.gpus import Gpu
from eval.devices.speed import decode_step_bytes, mid_generation_context
from quant.execution import Execution
from quant.precisions import get_precision


def positive_int(cfg: dict, key: str, default: int | None = None) -> int:
    """config.json's `key` (or `default` where it is absent or null) as a positive integer; ValueError if
    it is not one."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{key} is missing")
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} is {value!r}, not a positive integer")
    return value


@dataclass(frozen=True)
class Shape:
    """What sizing needs of a decoder-only transformer's config.json."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: dict) -> Shape:
        """The shape a config.json states; ValueError naming the first key that is missing or not a positive
        integer (a boolean is not one), a key-value head count that does not divide the heads, or
        `architectures` that is not a non-empty list of names."""
        arch = cfg.get("architectures", ["unnamed"])
        if not isinstance(arch, list) or not arch or not all(isinstance(a, str) and a for a in arch):
            raise ValueError(f"architectures is {arch!r}, not a non-empty list of names")
        heads, hidden = positive_int(cfg, "num_attention_heads"), positive_int(cfg, "hidden_size")
        kv_heads = positive_int(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
        if hidden // heads == 0 and cfg.get("head_dim") is None:
            raise ValueError(f"hidden_size {hidden} is smaller than num_attention_heads {heads}: set head_dim")
        return cls(
            layers=positive_int(cfg, "num_hidden_layers"),
            hidden=hidden,
            intermediate=positive_int(cfg, "intermediate_size"),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=positive_int(cfg, "head_dim", hidden // heads),
            vocab=positive_int(cfg, "vocab_size"),
            tied=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def linear_params(self) -> int:
        """Parameters of the quantized linear layers (attention and MLP projections)."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.intermediate)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        return self.linear_params + self.embedding_params + self.lm_head_params + self.norm_params

    @property
    def embedding_table_bytes(self) -> int:
        """Bytes of the input embedding table (16-bit) that a decode step indexes rather than reads; 0 when
        it is tied to the output layer, which reads it whole."""
        return 0 if self.tied else 2 * self.embedding_params

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token occupies: a key and a value vector per KV head per layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


def weight_bytes(shape: Shape, precision: str, group_size: int) -> float:
    """Bytes of all weights stored at `precision` (linear layers quantized, the rest 16-bit), scales and
    zero points included (quant/precisions.py)."""
    rest = shape.embedding_params + shape.lm_head_params + shape.norm_params
    return shape.linear_params * get_precision(precision).bytes_per_weight(group_size) + 2 * rest


def workspace_bytes(shape: Shape, prefill_tokens: int, act_bytes: int = 2) -> float:
    """Activation workspace of a prefill chunk: the widest live tensors of one layer (the MLP's gate and
    up projections, the residual, attention input and output) for `prefill_tokens` tokens, plus fp32
    logits for one token per sequence is negligible next to it."""
    per_token = (2 * shape.intermediate + 4 * shape.hidden) * act_bytes
    return prefill_tokens * per_token


KV_DTYPE_BYTES = {"auto": 2, "fp8": 1}
"""Bytes of a KV-cache entry per KV-cache dtype (vLLM's `--kv-cache-dtype`; auto: the 16-bit compute dtype)."""


@dataclass(frozen=True)
class Assumptions:
    """What sizing assumes; every number a projection rests on, stated and settable."""

    utilization: float = 0.9  # fraction of GPU memory the server may use (vLLM's default)
    runtime_reserve_gib: float = 1.0  # CUDA context, libraries, graphs
    prefill_tokens: int = 2048  # tokens per prefill chunk (activation workspace)
    kv_dtype_bytes: int = 2  # 1 where the build is served with an FP8 KV cache (pipelines/stages/size.py)
    mbu: float = 1.0  # fraction of peak bandwidth decode reaches (1.0: the ceiling)
    mfu: float = 1.0  # fraction of peak FLOP/s prefill reaches (1.0: the floor)

    def describe(self) -> str:
        """The assumptions in words, for the tables that rest on them."""
        return (
            f"{self.utilization:.0%} of memory, {self.runtime_reserve_gib:g} GiB reserve, {self.kv_dtype_bytes}-byte "
            f"KV entries; decode at {self.mbu:.0%} of peak bandwidth, TTFT at {self.mfu:.0%} of peak FLOP/s"
        )


@dataclass(frozen=True)
class Fit:
    gpu: str
    precision: str
    execution: Execution
    weights_gb: float
    kv_gb: float
    workspace_gb: float
    reserve_gb: float
    total_gb: float
    usable_gb: float
    fits: bool
    max_sequences: int  # at the given context, on one GPU (0: not even one)
    tensor_parallel: int | None  # GPUs needed (1, 2, 4, 8), None beyond 8
    decode_tps_per_user: float  # ceiling x MBU, at the given batch and context
    decode_tps_total: float
    ttft_ms: float  # prefill floor of one prompt of `input_len`
    why_not: str | None = None  # why no kernel runs the build on this GPU (execution no-kernel): its figures are moot


def fit(
    shape: Shape,
    precision: str,
    gpu: Gpu,
    *,
    batch: int,
    input_len: int,
    output_len: int,
    group_size: int,
    weights: float | None = None,
    a: Assumptions = Assumptions(),
) -> Fit:
    """Does `precision` of the model fit `gpu` at `batch` sequences of input + output tokens, and how fast.

    `weights`: the build's real weight bytes where it exists, else projected at `group_size`."""
    w = weight_bytes(shape, precision, group_size) if weights is None else weights
    context = input_len + output_len
    kv_tok = shape.kv_bytes_per_token(a.kv_dtype_bytes)
    kv = batch * context * kv_tok
    work = workspace_bytes(shape, min(a.prefill_tokens, batch * input_len))
    reserve = a.runtime_reserve_gib * 2**30
    usable = gpu.memory_bytes * a.utilization
    free_for_kv = usable - w - work - reserve
    tp = next((n for n in (1, 2, 4, 8) if w / n + kv / n + work + reserve <= usable), None)
    step = decode_step_bytes(
        w, shape.embedding_table_bytes, kv_tok, batch, mid_generation_context(input_len, output_len)
    )
    per_user = gpu.bandwidth * a.mbu / step
    flops = 2 * (shape.linear_params + shape.lm_head_params) * input_len
    flops += 4 * shape.layers * input_len**2 * shape.heads * shape.head_dim / 2  # causal attention scores and values
    ttft = flops / (gpu.compute_flops(precision) * a.mfu)
    return Fit(
        gpu=gpu.name,
        precision=precision,
        execution=gpu.execution(precision),
        weights_gb=w / 1e9,
        kv_gb=kv / 1e9,
        workspace_gb=work / 1e9,
        reserve_gb=reserve / 1e9,
        total_gb=(w + kv + work + reserve) / 1e9,
        usable_gb=usable / 1e9,
        fits=w + kv + work + reserve <= usable,
        max_sequences=max(0, math.floor(free_for_kv / (context * kv_tok))),
        tensor_parallel=tp,
        decode_tps_per_user=per_user,
        decode_tps_total=per_user * batch,
        ttft_ms=1000 * ttft,
        why_not=gpu.why_not(precision),
    )
