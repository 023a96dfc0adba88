"""`qeval init`: a validated card written from a model's config.json (a local folder, or a hub id whose
config is shipped to pipelines/models/configs/), saying what it guessed; and one line for what it cannot read."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, TINY

from pipelines.core.system.errors import QevalError


def test_init_writes_a_valid_card_for_a_local_folder_and_says_what_it_guessed(cards):
    from pipelines.core.card.cards import load_card
    from pipelines.scaffold import scaffold, write

    made = scaffold(str(REPO / "refmodel/ref-lm"), name="my-ref")
    path = write(made)
    card = load_card("my-ref")
    assert card.source.path == "refmodel/ref-lm" and made.shipped_config is None
    assert card.precisions == ["bf16", "fp8", "int8", "awq", "gptq"] and card.quantization.group_size == 128
    assert card.speed.input_len + card.speed.output_len <= 512  # ref-lm's 512 positions
    assert any("placeholders" in g for g in made.guesses) and any("speed grid" in g for g in made.guesses)
    with pytest.raises(QevalError, match="exists; pass --force"):
        write(made)
    assert write(made, force=True) == path


def test_init_from_a_hub_id_ships_its_config_and_picks_a_group_size_that_divides(cards, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from pipelines import scaffold as sc
    from pipelines.core.card.cards import load_card

    # the hub's cache as huggingface_hub lays it out, with an architecture whose widths 128 does not divide
    snapshot = tmp_path / "hub" / "models--acme--Tiny-Chat" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({**TINY, "hidden_size": 320, "intermediate_size": 960}))
    (tmp_path / "hub" / "models--acme--Tiny-Chat" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--Tiny-Chat" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(sc, "CONFIGS", tmp_path / "configs")
    made = sc.scaffold("acme/Tiny-Chat")
    assert made.name == "tiny-chat" and made.shipped_config == tmp_path / "configs" / "tiny-chat.json"
    sc.write(made)
    card = load_card("tiny-chat")
    assert card.source.hub_id == "acme/Tiny-Chat" and card.source.config == str(tmp_path / "configs/tiny-chat.json")
    assert card.quantization.group_size == 64 and any("group size 64" in g for g in made.guesses)
    assert json.loads(made.shipped_config.read_text())["hidden_size"] == 320
    # the config already shipped for another model of that name, whose card is in another cards folder: it is not
    # replaced without --force (issue 67)
    made.shipped_config.write_text(json.dumps(TINY))
    cards("tiny-chat", "").unlink()
    with pytest.raises(QevalError, match=r"tiny-chat\.json exists with another architecture; pass --force"):
        sc.write(made)
    assert json.loads(made.shipped_config.read_text()) == TINY
    sc.write(made, force=True)


def test_init_refuses_what_it_cannot_read_in_one_line(cards, tmp_path, monkeypatch):
    from pipelines.scaffold import scaffold

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QevalError, match=r"has no config\.json"):
        scaffold(str(tmp_path))
    with pytest.raises(QevalError, match="neither a folder nor a hub id"):
        scaffold("no-such-thing")
    with pytest.raises(QevalError, match="--name"):
        scaffold(str(REPO / "refmodel/ref-lm"), name="Bad Name")


def test_a_path_or_name_from_outside_stays_one_value_in_the_card(cards, tmp_path):
    """A folder named `m #x` was written as `path: .../m #x`, which YAML reads as `.../m`, another model; an
    architecture name holding a newline and `gate:` added a key (issue 41)."""
    from pipelines.core.card.cards import load_card
    from pipelines.scaffold import scaffold, write

    folder = tmp_path / "src" / "m #x"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**TINY, "architectures": ["Llama\ngate:\n  min_recovery: 0"]}))
    made = scaffold(str(folder), name="odd")
    write(made)
    card = load_card("odd")
    assert card.source.path == str(folder) and card.gate.min_recovery == 0.99
    assert card.description.startswith("Llama\ngate:\n  min_recovery: 0 from ")


def test_a_card_that_gives_a_key_twice_is_refused_in_one_line(cards):
    from pipelines.core.card.cards import load_card

    text = (REPO / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", "name: twice")
    cards("twice", text + "gate:\n  baseline: bf16\n  min_recovery: 0.5\n")
    with pytest.raises(QevalError, match=r"twice\.yaml:\d+:\d+: not valid YAML: key 'gate' is given twice"):
        load_card("twice")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"hidden_size": -256}, "hidden_size is -256, not a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers is 0, not a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads is 0, not a positive integer"),
        ({"vocab_size": True}, "vocab_size is True, not a positive integer"),
        ({"intermediate_size": 512.5}, "intermediate_size is 512.5, not a positive integer"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
        ({"architectures": []}, r"architectures is \[\], not a non-empty list of names"),
        ({"max_position_embeddings": 1}, "max_position_embeddings is 1; qeval makes cards for a context of 16"),
    ],
)
def test_init_refuses_a_shape_no_model_has_in_one_line(cards, tmp_path, change, says):
    """`hidden_size: -256` made a card that `qeval size` said fits, with a negative KV cache; zero layers or
    heads and empty architectures were tracebacks, a context of 1 "a qeval bug" (issue 41)."""
    from pipelines.scaffold import scaffold

    (tmp_path / "config.json").write_text(json.dumps({**TINY, **change}))
    with pytest.raises(QevalError, match=says):
        scaffold(str(tmp_path), name="bad")
    assert not (tmp_path / "cards" / "bad.yaml").exists()
