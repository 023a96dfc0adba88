"""Speed and memory arithmetic: pure functions on numbers (definitions in docs/measurement.md, "Definitions")."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def tpot_s(ttft_s: float, e2e_s: float, output_tokens: int) -> float:
    """Time per output token after the first: (e2e - TTFT) / (output tokens - 1), as vLLM defines it."""
    if output_tokens < 2:
        return math.nan
    return (e2e_s - ttft_s) / (output_tokens - 1)


def mid_generation_context(input_len: int, output_len: int) -> float:
    """The context a decode step of a generation attends to on average: the prompt and half the output."""
    return input_len + output_len / 2


def decode_step_bytes(
    weight_bytes: float, embedding_bytes: float, kv_per_token: float, batch: int, context: float
) -> float:
    """Bytes a decode step reads from memory: every weight once but the input embedding table, plus each
    sequence's KV cache at `context` tokens.

    The embedding table is only indexed (one row per token), so its bytes are not read per step; give
    `embedding_bytes` 0 where it is tied to the output layer, which reads it whole. Engine MBU, the
    sizing ceiling and the size stage's check of the bench all count bytes this way."""
    return weight_bytes - embedding_bytes + batch * kv_per_token * context


def mbu(step_bytes: float, steps_per_s: float, bandwidth_bytes_per_s: float) -> float:
    """Model bandwidth utilisation: bytes read per decode step x steps per second / peak bandwidth."""
    return step_bytes * steps_per_s / bandwidth_bytes_per_s


def speedup_is_suspect(speedup: float, byte_ratio: float, slack: float = 1.15) -> bool:
    """A decode speed-up beyond what the smaller weights allow (with slack for noise) is suspect."""
    return speedup > byte_ratio * slack
