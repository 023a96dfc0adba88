from __future__ import annotations

import re

import pytest

from pipelines.core.card.cards import card_names, load_card, parse_card
from pipelines.core.system.errors import QevalError
from pipelines.core.system.paths import REPO_ROOT
from quant.precisions import PRECISIONS

REF_CARD = (REPO_ROOT / "pipelines/models/ref-lm.yaml").read_text()


def test_shipped_cards_are_valid():
    names = card_names()
    assert "ref-lm" in names and len(names) >= 2
    for name in names:
        card = load_card(name)
        assert card.name == name
        assert card.gate.baseline in card.precisions


def test_ref_lm_card_points_at_the_embedded_model():
    card = load_card("ref-lm")
    assert card.source.path == "refmodel/ref-lm" and card.source.trust_remote_code is False
    formats = load_card("ref-lm-formats")
    assert formats.source.path == card.source.path and formats.accuracy == card.accuracy
    # every precision is built from the embedded model, by one card or the other (the new formats by their own)
    assert set(card.precisions) | set(formats.precisions) == {*PRECISIONS, "int8+kv-fp8"}


def _error(cards, text: str, name: str = "bad") -> str:
    cards(name, text)
    with pytest.raises(QevalError) as e:
        load_card(name)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{name}.yaml" in msg
    return msg


def test_unknown_key_is_named_with_a_suggestion(cards):
    msg = _error(cards, REF_CARD.replace("name: ref-lm", "name: bad").replace("batch_sizes:", "batch_size:"))
    assert "unknown key 'speed.batch_size' (did you mean 'batch_sizes'?)" in msg
    assert "allowed here: batch_sizes, input_lengths" in msg


def test_wrong_type_names_key_and_kind_of_value(cards):
    msg = _error(cards, REF_CARD.replace("name: ref-lm", "name: bad").replace("repeats: 5", "repeats: many"))
    assert "key 'speed.repeats'" in msg and "(got a string of 4 characters)" in msg and "many" not in msg


def test_missing_key(cards):
    text = "\n".join(
        line
        for line in REF_CARD.replace("name: ref-lm", "name: bad").splitlines()
        if not line.startswith("description")
    )
    assert "missing key 'description'" in _error(cards, text)


def test_cross_field_rules(cards):
    base = REF_CARD.replace("name: ref-lm", "name: bad")
    assert "key 'precisions.1': not a precision qeval builds (did you mean 'fp8'?)" in _error(
        cards, base.replace("[bf16, fp8,", "[bf16, fp9,")
    )
    assert "gate.baseline 'fp8'" in _error(
        cards, base.replace("precisions: [bf16, fp8,", "precisions: [bf16,").replace("baseline: bf16", "baseline: fp8")
    )
    no_calib = re.sub(r"calibration:\n(  .*\n)+", "", base)
    assert "precisions ['int8', 'awq', 'gptq'] need a 'calibration' section" in _error(cards, no_calib)
    both = base.replace("  path: refmodel/ref-lm", "  path: refmodel/ref-lm\n  hub_id: x/y")
    assert "exactly one of 'path' or 'hub_id'" in _error(cards, both)


def test_a_kv_cache_variant_follows_the_build_whose_checkpoint_it_serves(cards):
    base = REF_CARD.replace("name: ref-lm", "name: bad")
    early = base.replace("[bf16, fp8, int8, awq, gptq, int8+kv-fp8]", "[bf16, fp8, int8+kv-fp8, int8, awq, gptq]")
    assert "precisions: int8+kv-fp8 serves int8's checkpoint" in _error(cards, early)
    assert "not as gate.baseline" in _error(
        cards, base.replace("[bf16,", "[bf16, bf16+kv-fp8,").replace("baseline: bf16", "baseline: bf16+kv-fp8")
    )
    card_wide = base.replace("server:\n", "server:\n  kv_cache_dtype: fp8\n", 1)
    assert "with server.kv_cache_dtype auto" in _error(cards, card_wide)
    assert "key 'precisions.5': not a precision qeval builds (did you mean 'int8+kv-fp8'?)" in _error(
        cards, base.replace("int8+kv-fp8", "int8+kv-fp4")
    )


def test_name_must_match_file(cards):
    assert "file is named 'other.yaml'" in _error(cards, REF_CARD, name="other")


def test_malformed_yaml(cards):
    assert re.search(r"bad\.yaml:3:\d+: not valid YAML", _error(cards, "name: bad\ndescription: x\nspeed: [unclosed"))
    assert "YAML mapping" in _error(cards, "- just\n- a list\n")


def test_a_wrong_value_is_described_not_echoed(cards):
    token = "hf_" + "x" * 34  # pasted into the wrong key
    message = _error(
        cards, REF_CARD.replace("name: ref-lm", "name: bad").replace("batch_size: 32", f"batch_size: {token}")
    )
    assert "accuracy.batch_size" in message and "a string of 37 characters" in message and token not in message
    assert "(got 0)" in _error(
        cards, REF_CARD.replace("name: ref-lm", "name: bad").replace("batch_size: 32", "batch_size: 0")
    )


def test_unknown_model_lists_known_ones(cards):
    with pytest.raises(QevalError, match=r"unknown model 'ref-ln' \(did you mean 'ref-lm'\?\); known: ref-lm"):
        load_card("ref-ln")


def test_parse_card_reads_a_path(tmp_path):
    path = tmp_path / "ref-lm.yaml"
    path.write_text(REF_CARD)
    assert parse_card(path).accuracy.tasks[0] == "refkjv_ppl"


TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567"


@pytest.mark.parametrize(
    "old, new",
    [
        ("[bf16, fp8, int8, awq, gptq, int8+kv-fp8]", f"[bf16, fp8, {TOKEN}]"),
        ("[bf16, fp8, int8, awq, gptq, int8+kv-fp8]", '[bf16, "fp8\\e[2J\\e[32mqeval: ships fp8"]'),
        ("baseline: bf16", f"baseline: {TOKEN}"),
        ("precisions:", f"target_gpus: [h100-sxm, {TOKEN}]\nprecisions:"),
        ("gate:\n", f"gate:\n  cost_on: {TOKEN}\n"),
        ("refkjv_needle: refkjv_needle_control", f"{TOKEN}: refkjv_needle_control"),
        ("tasks: [refkjv_ppl,", f"tasks: [{TOKEN}, refkjv_ppl,"),
        ("tasks: [refkjv_ppl,", 'tasks: ["x\\e[2J", refkjv_ppl,'),
        ("target: gptq", f"target: {TOKEN}"),
    ],
)
def test_a_name_the_card_gives_is_checked_where_it_is_read_and_never_printed_back(cards, old, new):
    """A token pasted into a key that names something, or an escape sequence, is refused in one line that names
    the key and does not repeat the value."""
    text = REF_CARD.replace("name: ref-lm", "name: bad")
    assert old in text, old
    message = _error(cards, text.replace(old, new, 1))
    assert TOKEN not in message and "\x1b" not in message and "AbCdEf" not in message, message


def test_mixes_controls_and_keys_that_cannot_be_are_refused(cards):
    base = REF_CARD.replace("name: ref-lm", "name: bad")
    mixed = base.replace("int8+kv-fp8]", "int8+kv-fp8, gptq+0xint8]")
    assert "gptq+0xint8: a mixed build keeps at least one layer group at int8" in _error(cards, mixed)
    own = base.replace("refkjv_needle: refkjv_needle_control", "refkjv_needle: refkjv_needle")
    assert "gate.controls: ['refkjv_needle'] would be their own controls" in _error(cards, own)
    assert re.search(
        r"bad\.yaml:\d+:\d+: not valid YAML: a key is a list, not a name", _error(cards, base + "? [a, b]\n: 1\n")
    )
