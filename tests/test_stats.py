import random

import pytest

from eval.stats import decide, mcnemar_exact, paired_bootstrap_ci


def test_mcnemar_exact_by_hand():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 * 0.5**5)
    assert mcnemar_exact(9, 1) == pytest.approx(2 * (1 + 10) / 1024)
    assert mcnemar_exact(5, 5) == 1.0


def test_bootstrap_interval_contains_the_mean_and_shrinks_with_n():
    rng = random.Random(1)
    base = [rng.random() for _ in range(400)]
    build = [x - 0.01 + rng.gauss(0, 0.05) for x in base]
    mean, lo, hi = paired_bootstrap_ci(base, build)
    assert lo < mean < hi and mean == pytest.approx(-0.01, abs=0.01)
    _, lo4, hi4 = paired_bootstrap_ci(base[:25], build[:25])
    assert hi4 - lo4 > hi - lo
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0], [])


def _pair(n: int, loss: float, seed: int = 0) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    base = [float(rng.random() < 0.7) for _ in range(n)]
    return base, [x - loss + rng.gauss(0, 0.3) for x in base]  # per-document noise, mean loss `loss`


def test_same_quality_is_inconclusive_at_a_small_sample_and_passes_at_a_large_one():
    small = decide(*_pair(30, 0.0), allowed_loss=0.02)
    assert small.verdict == "INCONCLUSIVE" and small.n_to_decide > 30
    large = decide(*_pair(20000, 0.0), allowed_loss=0.02)
    assert large.verdict == "PASS" and large.lower >= -0.02


def test_a_clear_loss_fails_and_lower_is_better_flips_the_sign():
    assert decide(*_pair(5000, 0.1), allowed_loss=0.02).verdict == "FAIL"
    base = [2.0 + 0.01 * i for i in range(100)]
    worse_ppl = [x + 0.5 for x in base]
    assert decide(base, worse_ppl, allowed_loss=0.1, higher_is_better=False).verdict == "FAIL"
    assert decide(base, [x - 0.5 for x in base], allowed_loss=0.1, higher_is_better=False).verdict == "PASS"
