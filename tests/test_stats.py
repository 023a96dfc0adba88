import math
import random

import numpy as np
import pytest

from eval.quality.paired import Departures, departure
from eval.quality.stats import Verdict, aggregate, compare, doc_terms, length_band, mcnemar_exact, samples_to_decide


def test_mcnemar_exact_by_hand():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 * 0.5**5)
    assert mcnemar_exact(9, 1) == pytest.approx(2 * (1 + 10) / 1024)
    assert mcnemar_exact(5, 5) == 1.0


def test_bits_per_byte_and_perplexity_aggregate_like_lm_eval():
    num, den = doc_terms([[-10.0, 8], [-6.0, 8]])  # two documents, 16 bytes, 16 nats
    assert aggregate("bits_per_byte", num.sum(), den.sum()) == pytest.approx(1 / math.log(2))
    assert aggregate("word_perplexity", num.sum(), den.sum()) == pytest.approx(math.e)
    n2, d2 = doc_terms([1.0, 0.0, 1.0, 1.0])
    assert aggregate("acc", n2.sum(), d2.sum()) == 0.75


def _accuracy_pair(n: int, p_flip_down: float, p_flip_up: float, seed: int = 0) -> tuple[list[float], list[float]]:
    """Baseline right on 80 % of documents; the build flips some answers down and some up."""
    rng = random.Random(seed)
    base, build = [], []
    for _ in range(n):
        a = float(rng.random() < 0.8)
        r = rng.random()
        b = 0.0 if a and r < p_flip_down else 1.0 if not a and r < p_flip_up else a
        base.append(a)
        build.append(b)
    return base, build


def test_same_quality_is_inconclusive_at_a_small_sample_and_passes_at_a_large_one():
    # a build that flips 5 % of answers each way: same accuracy on average, noisy on few documents
    small = compare("acc", *_accuracy_pair(40, 0.05, 0.2), higher_is_better=True, threshold=0.98)
    assert small.verdict == "INCONCLUSIVE"
    assert small.n_to_decide is not None and small.n_to_decide > 40
    large = compare("acc", *_accuracy_pair(5000, 0.05, 0.2), higher_is_better=True, threshold=0.98)
    assert large.verdict == "PASS" and large.recovery[1] >= 0.98
    assert large.n_to_decide < 5000  # decided with room: about half of them would have done
    lo, hi = large.recovery[1], large.recovery[2]
    assert lo <= large.recovery[0] <= hi
    assert large.mcnemar_p is not None and large.discordant[0] > 0 and large.discordant[1] > 0


def test_a_clear_loss_fails_with_a_significant_mcnemar():
    c = compare("acc", *_accuracy_pair(3000, 0.2, 0.0), higher_is_better=True, threshold=0.97)
    assert c.verdict == "FAIL" and c.recovery[2] < 0.97
    assert c.difference[0] == pytest.approx(c.build - c.baseline)
    assert c.discordant[1] == 0 and c.mcnemar_p < 1e-6


def test_lower_is_better_metrics_use_baseline_over_build():
    rng = random.Random(3)
    base = [[-rng.uniform(800, 1200), 1000] for _ in range(200)]  # about 1.44 bits per byte
    worse = [[ll * 1.10 + rng.gauss(0, 1), n] for ll, n in base]  # 10 % more bits on every document
    c = compare("bits_per_byte", base, worse, higher_is_better=False, threshold=0.97)
    assert c.build > c.baseline and c.recovery[0] == pytest.approx(c.baseline / c.build)
    assert c.verdict == "FAIL" and c.mcnemar_p is None
    same = compare("bits_per_byte", base, base, higher_is_better=False, threshold=0.97)
    assert same.verdict == "PASS" and same.recovery == (1.0, 1.0, 1.0)


def test_perplexity_rule_bounds_the_relative_perplexity_increase():
    base = [[-1000.0 - 10 * (i % 7), 1000] for i in range(300)]
    plus1pct = [[ll - 1000 * math.log(1.01), n] for ll, n in base]  # perplexity exactly 1 % higher
    ok = compare("bits_per_byte", base, plus1pct, higher_is_better=False, rule="ppl_increase", threshold=0.02)
    assert ok.verdict == "PASS" and ok.ppl_increase[0] == pytest.approx(0.01)
    bad = compare("bits_per_byte", base, plus1pct, higher_is_better=False, rule="ppl_increase", threshold=0.005)
    assert bad.verdict == "FAIL"
    with pytest.raises(ValueError, match="log-likelihoods"):
        compare("acc", [1.0], [1.0], higher_is_better=True, rule="ppl_increase", threshold=0.01)


def test_bad_pairs_are_refused():
    with pytest.raises(ValueError):
        compare("acc", [1.0], [], higher_is_better=True)


def test_samples_to_decide_scales_with_the_square_of_the_interval():
    assert samples_to_decide(100, point=1.0, lower=0.96, upper=1.04, threshold=0.98) == 400
    assert samples_to_decide(100, point=0.98, lower=0.9, upper=1.0, threshold=0.98) is None
    # decided already: how many documents it needed (a quarter here), never more than it had
    assert samples_to_decide(100, point=1.0, lower=0.99, upper=1.01, threshold=0.98) == 25
    assert samples_to_decide(100, point=1.0, lower=0.999, upper=1.001, threshold=0.98) == 1
    # six documents where the baseline scored nothing on some resamples: an interval of NaN or infinity says nothing
    assert samples_to_decide(6, point=1.0, lower=math.nan, upper=math.inf, threshold=0.99) is None
    assert samples_to_decide(6, point=math.inf, lower=0.5, upper=math.inf, threshold=0.99) is None


def test_length_band_holds_output_length_to_the_baselines():
    rng = np.random.default_rng(0)
    base = rng.integers(10, 30, size=300).astype(float)
    same = length_band(base, base + rng.integers(-1, 2, size=300), band=0.10)
    assert same.verdict == Verdict.PASS and 0.9 < same.ratio[1] <= same.ratio[2] < 1.1
    rambles = length_band(base, base * 1.3, band=0.10)  # every output 30 % longer: beyond the band
    assert rambles.verdict == Verdict.FAIL and rambles.ratio[0] == pytest.approx(1.3)
    assert rambles.build == pytest.approx(1.3 * rambles.baseline)
    terse = length_band(base, np.ceil(base * 0.5), band=0.10)
    assert terse.verdict == Verdict.FAIL and terse.ratio[2] < 0.9
    # 10 % longer on average over few, noisy documents: the interval straddles the band's edge
    few = rng.integers(5, 40, size=12).astype(float)
    edge = length_band(few, few * 1.1 + rng.normal(0, 4, size=12), band=0.10)
    assert edge.verdict == Verdict.INCONCLUSIVE and edge.ratio[1] < 1.1 < edge.ratio[2]
    with pytest.raises(ValueError):
        length_band([1.0], [1.0, 2.0], band=0.1)


def test_departure_is_the_first_token_that_differs():
    assert departure([5, 6, 7], [5, 6, 7]) is None
    assert departure([5, 6, 7], [9, 6, 7]) == 0
    assert departure([5, 6, 7], [5, 6, 8, 9]) == 2
    assert departure([5, 6, 7], [5, 6]) == 2  # stops early: departs where it stopped
    assert departure([5], [5, 6]) == 1
    d = Departures([None, 0, 4, 2, None, 9])
    assert d.identical == 2 and d.median == 3.0
    assert d.text() == "median departure at token 3, 2 of 6 outputs identical"
    assert Departures([None, None]).median is None and "none departs" in Departures([None]).text()


def test_the_flip_rate_by_hand():
    from eval.quality.stats import flip_rate

    # 3 of 5 answers changed: p = 0.6; Wilson's interval at z = 1.959964 is
    # (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    f = flip_rate([0, 1, 0, 2, 3], [0, 2, 1, 0, 3])
    z, n, p = 1.959964, 5, 0.6
    centre, half = (p + z * z / (2 * n)), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert (f.n, f.flipped) == (5, 3)
    assert f.rate == pytest.approx(
        (0.6, (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)), abs=1e-5
    )
    assert flip_rate([1, 1], [1, 1]).rate[:2] == (0.0, 0.0)
    with pytest.raises(ValueError):
        flip_rate([1], [1, 2])


def _choices_folder(folder, picks: list[list[float]], delimiter: str = "\n"):
    """A multiple-choice task's per-document records as lm-eval writes them: per choice its log-likelihood, and
    its argument (context, delimiter + choice); choices "a", "bbbb", "cc"; the answer is choice 0."""
    import json

    from helpers import accuracy_result

    from eval.quality.records import Metric

    folder.mkdir()
    rows = [
        {
            "doc_id": i,
            "arguments": [["ctx", delimiter + c] for c in ("a", "bbbb", "cc")],
            "filtered_resps": [[ll, False] for ll in lls],
            "filter": "none",
            "acc": float(max(range(3), key=lls.__getitem__) == 0),
            "acc_norm": 0.0,
        }
        for i, lls in enumerate(picks)
    ]
    (folder / "samples_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "lm_eval_results.json").write_text(json.dumps({"configs": {"mc": {"target_delimiter": delimiter}}}))
    metrics = [Metric(name="acc", value=0.5), Metric(name="acc_norm", value=0.5)]
    result = accuracy_result({"mc": metrics}, n_samples={"mc": len(rows)})
    return folder, result


def test_a_builds_changed_answers_are_counted_as_its_judging_metric_picks_them(tmp_path):
    from eval.quality.paired import Scored, flips

    # by log-likelihood: base picks 0, 1, 0, 2; build picks 0, 2, 1, 0: three changed (wrong to wrong, right to
    # wrong, wrong to right)
    base = Scored(*_choices_folder(tmp_path / "base", [[-2, -4, -9], [-5, -1, -9], [-1, -3, -9], [-9, -9, -1]]))
    build = Scored(*_choices_folder(tmp_path / "build", [[-2, -4.5, -9], [-5, -9, -1], [-3, -1, -9], [-1, -9, -9]]))
    by_acc = flips("mc", base, build, confidence=0.95, metric="acc")
    assert (by_acc.n, by_acc.flipped) == (4, 3)
    # per character of the choice (1, 4 and 2, the delimiter left out): base picks 1, 1, 1, 2 (the third: -3 / 4
    # over -1 / 1); build 1, 2, 1, 0: two changed. Counting the delimiter (2, 5, 3) the base would pick 0 in the
    # third and three would have changed
    by_char = flips("mc", base, build, confidence=0.95, metric="acc_norm")
    assert (by_char.n, by_char.flipped) == (4, 2)
    assert flips("mc", base, build, confidence=0.95) == by_char  # acc_norm judges where it is reported


def test_a_task_without_choices_has_no_flips(tmp_path):
    import json

    from eval.quality.paired import Scored, flips

    folder, result = _choices_folder(tmp_path / "base", [[-1, -2, -3]])
    rows = [{"doc_id": 0, "filtered_resps": [[-3.0, 5]], "filter": "none", "acc": 1.0}]  # one loglikelihood pair
    (folder / "samples_mc.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert flips("mc", Scored(folder, result), Scored(folder, result), confidence=0.95, metric="acc") is None
