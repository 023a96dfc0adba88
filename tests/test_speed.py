import math

import pytest

from eval.speed import decode_step_bytes, mbu, percentile, speedup_is_suspect, tpot_s


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
    assert decode_step_bytes(1000, 10, batch=4, context=5) == 1200


def test_speedup_beyond_the_byte_ratio_is_suspect():
    assert not speedup_is_suspect(1.8, byte_ratio=2.0)
    assert speedup_is_suspect(3.0, byte_ratio=2.0)
