"""`qeval init`: a validated card written from a model's config.json (a local folder, or a hub id whose
config is shipped to eval/configs/), saying what it guessed; and one line for what it cannot read."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, TINY

from pipelines.core.errors import QevalError


def test_init_writes_a_valid_card_for_a_local_folder_and_says_what_it_guessed(cards):
    from pipelines.core.cards import load_card
    from pipelines.core.scaffold import scaffold, write

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

    from pipelines.core import scaffold as sc
    from pipelines.core.cards import load_card

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


def test_init_refuses_what_it_cannot_read_in_one_line(cards, tmp_path, monkeypatch):
    from pipelines.core.scaffold import scaffold

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QevalError, match=r"has no config\.json"):
        scaffold(str(tmp_path))
    with pytest.raises(QevalError, match="neither a folder nor a hub id"):
        scaffold("no-such-thing")
    with pytest.raises(QevalError, match="--name"):
        scaffold(str(REPO / "refmodel/ref-lm"), name="Bad Name")
