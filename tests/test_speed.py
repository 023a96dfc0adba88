import math

import pytest

from eval.devices.speed import decode_step_bytes, mbu, mid_generation_context, percentile, speedup_is_suspect, tpot_s


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5, 1, 3], 90) == pytest.approx(4.6)
    assert percentile([7], 99) == 7 and math.isnan(percentile([], 50))


def test_tpot_excludes_the_first_token():
    assert tpot_s(ttft_s=0.1, e2e_s=1.0, output_tokens=10) == pytest.approx(0.1)
    assert math.isnan(tpot_s(0.1, 0.1, 1))


def test_mbu_of_a_bandwidth_bound_decode():
    # Llama-2-7B bf16 reads 13.2 GB per token; at 254 tokens/s an H100 SXM (3.35 TB/s) is saturated
    assert mbu(13.2e9, 254, 3.35e12) == pytest.approx(1.0, abs=0.01)
    # 1,000 bytes of weights of which a 100-byte embedding table is only indexed, 4 sequences of 5 tokens
    assert decode_step_bytes(1000, 100, 10, batch=4, context=5) == 900 + 4 * 10 * 5
    assert decode_step_bytes(1000, 0, 10, batch=1, context=5) == 1050  # tied: the table is the output layer


def test_a_decode_step_attends_to_the_prompt_and_half_the_output_on_average():
    assert mid_generation_context(128, 32) == 144
    assert mid_generation_context(128, 33) == 144.5  # not rounded down


def test_speedup_beyond_the_byte_ratio_is_suspect():
    assert not speedup_is_suspect(1.8, byte_ratio=2.0)
    assert speedup_is_suspect(3.0, byte_ratio=2.0)
