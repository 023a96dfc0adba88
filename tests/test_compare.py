import math

import pytest

from eval.quality.compare import recoveries, recovery


def test_recovery_is_one_when_as_good_either_way():
    assert recovery(0.5, 0.5, True) == 1.0
    assert recovery(0.45, 0.5, True) == pytest.approx(0.9)
    # perplexity 11 against a baseline of 10 is a loss: 10 / 11
    assert recovery(11.0, 10.0, False) == pytest.approx(10 / 11)
    assert recovery(0.0, 0.0, True) == 1.0 and recovery(1.0, 0.0, True) == math.inf


def test_recoveries_pair_the_metrics_both_tables_have():
    build = {"t": {"acc": 0.4, "bpb": 2.2, "exact_match/strict-match": 0.3}, "u": {"acc": 1.0}}
    base = {"t": {"acc": 0.5, "bpb": 2.0, "exact_match/strict-match": 0.0}}
    hib = {"t": {"acc": True, "bpb": False}}
    assert recoveries(build, base, hib) == {
        "t": {"acc": pytest.approx(0.8), "bpb": pytest.approx(2.0 / 2.2), "exact_match/strict-match": math.inf}
    }
