"""The embedded reference model: its splits, its shape, and that it has really learned."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
from safetensors import safe_open

from refmodel import corpus
from refmodel.quality import SAMPLE_EVERY, UNIGRAM_FILE, measure_quality, unigram_bits

SAMPLE = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void.

Genesis 2

  1 Thus the heavens and the earth were finished.
"""


def test_parse_chapters():
    chapters = corpus.parse_chapters(SAMPLE)
    assert [c.id for c in chapters] == ["Genesis 1", "Genesis 2"]
    assert (
        chapters[0].text
        == "In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void."
    )


def test_split_rule_is_deterministic_and_calibration_is_never_held_out():
    splits = [corpus.split_of(i) for i in range(1189)]
    calibration = [i for i in range(1189) if corpus.is_calibration(i)]
    assert splits.count("heldout") == 119 and len(calibration) == 60
    assert splits[7] == splits[13] == "heldout" and splits[0] == "train"
    assert {splits[i] for i in calibration} == {"train"}  # a sample of what the model read, not of its tasks' text


def test_committed_splits_match_their_digests():
    info = json.loads(corpus.SPLITS_FILE.read_text())
    for name, path in (("heldout", corpus.HELDOUT_FILE), ("calibration", corpus.CALIBRATION_FILE)):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == info["sha256"][name]
    heldout = {c.id for c in corpus.read_jsonl(corpus.HELDOUT_FILE)}
    calibration = {c.id for c in corpus.read_jsonl(corpus.CALIBRATION_FILE)}
    assert len(heldout) == info["chapters"]["heldout"] and not heldout & calibration


def test_every_linear_input_width_is_divisible_by_128():
    with safe_open(str(corpus.MODEL_DIR / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if name.endswith("proj.weight") or name == "lm_head.weight":
                assert f.get_slice(name).get_shape()[1] % 128 == 0, name
    assert (corpus.MODEL_DIR / "model.safetensors").stat().st_size < 50e6


def test_unigram_bits_by_hand():
    # counts 3 and 1, add-one smoothed: p(0) = 4/6, p(1) = 2/6
    assert unigram_bits([3, 1], [0, 1]) == pytest.approx(-math.log2(4 / 6) - math.log2(2 / 6))


@pytest.mark.slow
def test_model_beats_unigram_and_matches_the_committed_figures():
    q = measure_quality(corpus.MODEL_DIR, SAMPLE_EVERY)  # quality.json's sample of the held-out chapters
    committed = json.loads((corpus.DATA_DIR / "quality.json").read_text())["sample"]
    assert q["heldout_chapters"] == committed["heldout_chapters"] == 15
    assert q["model_bits_per_byte"] == pytest.approx(committed["model_bits_per_byte"], abs=2e-3)
    assert q["unigram_bits_per_byte"] == pytest.approx(committed["unigram_bits_per_byte"], abs=1e-4)
    assert q["model_bits_per_byte"] < 0.8 * q["unigram_bits_per_byte"]
    assert len(json.loads(UNIGRAM_FILE.read_text())["counts"]) == 4096
