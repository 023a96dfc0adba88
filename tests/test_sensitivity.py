"""Per-layer sensitivity (quant/sensitivity.py): the groups that share a format, the target scheme's weights
quantized and back, and a layer made fragile on purpose ranked first, on a small random Llama; `qeval sensitivity`
reading back the ranking of the session's pipeline run."""

from __future__ import annotations

import itertools
from pathlib import Path

import lanes
import pytest

from quant.sensitivity import fake_quantized, halves, layer_groups, rank, weight_args

pytestmark = pytest.mark.integration

FRAGILE = "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def tiny():
    """A two-layer Llama with random weights (128 wide, so that a 128-channel group fits every layer), and two
    batches of random token ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    batches = [torch.randint(0, 256, (2, 32)) for _ in range(2)]
    return model, batches


def test_layers_that_vllm_fuses_are_one_group_and_the_ignored_none(tiny):
    model, _ = tiny
    groups = layer_groups(model, ["lm_head"])
    assert [g.name for g in groups[:4]] == [
        "model.layers.0.self_attn.q_proj+k_proj+v_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj+up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert len(groups) == 8 and groups[0].modules == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert not [g for g in groups if "lm_head" in g.name]
    assert len(layer_groups(model, ["lm_head", "re:.*down_proj"])) == 6


def test_the_target_schemes_weights_are_its_recipes(tiny):
    import torch

    gptq, awq, int8 = (weight_args(p, 128, ["lm_head"]) for p in ("gptq", "awq", "int8"))
    assert (gptq.num_bits, gptq.group_size, gptq.symmetric) == (4, 128, True)
    assert (awq.num_bits, awq.group_size, awq.symmetric) == (4, 128, False)
    assert (int8.num_bits, int8.group_size) == (8, None)
    with pytest.raises(ValueError, match="not a quantized precision"):
        weight_args("bf16", 128, [])
    # 4-bit symmetric, by hand: each group of 128 inputs has one scale, its largest magnitude over 7.5
    # (compressed-tensors maps the range [-8, 7] onto [-absmax, absmax]), and every weight is an integer step of it
    w = tiny[0].model.layers[0].mlp.down_proj.weight.detach()
    q = fake_quantized(w, gptq)
    assert q.shape == w.shape and q.dtype == w.dtype and not torch.equal(q, w)
    for group, quantized in zip(w.reshape(-1, 128), q.reshape(-1, 128), strict=True):
        steps = quantized / (group.abs().max() / 7.5)
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.min() >= -8 and steps.max() <= 7 + 1e-4
        assert (quantized - group).abs().max() <= group.abs().max() / 7.5 / 2 + 1e-6  # round to nearest


def test_a_layer_made_fragile_ranks_first_and_the_halves_agree(tiny):
    import torch

    model, batches = tiny
    layer = dict(model.named_modules())[FRAGILE]
    kept = layer.weight.data.clone()
    try:
        with torch.no_grad():  # one outlier per group of 128 inputs: the 4-bit step it sets rounds most of the
            layer.weight[:, ::128] = 12 * kept.std()  # rest of the group to zero
        args = weight_args("gptq", 128, ["lm_head"])
        seen = []
        ranked = rank(model, layer_groups(model, ["lm_head"]), args, batches, lambda d, n: seen.append((d, n)))
        assert ranked[0].group.name == FRAGILE and ranked[0].kl > 3 * ranked[1].kl > 0
        assert seen[-1] == (8, 8)
        top, bottom = halves(model, ranked, args, batches)
        assert top > bottom > 0
        assert torch.equal(layer.weight.data[:, 1:128], kept[:, 1:128])  # every weight put back
    finally:
        layer.weight.data = kept


def _sensitivity_read_back(folder: Path, env: dict[str, str], run: Path) -> dict:
    """`qeval sensitivity` in a copy of the session's pipeline run, once it has ended: the card's target, then
    a precision that quantizes nothing and one that does not exist. Beside the tests (tests/lanes.py)."""
    from helpers import qeval, root_env

    from conftest import copy_root

    env = root_env(copy_root(run, folder / "run"), env)
    # the precision: the card's search target (gptq), its sensitive groups kept at the search's fallback (int8)
    return {
        p: qeval("sensitivity", "-m", "ref-small", *p, env=env)
        for p in (("--json",), ("--precision", "bf16"), ("--precision", "nope"))
    }


sensitivity_read_back = lanes.side_job("sensitivity_read_back", _sensitivity_read_back, after="pipeline_run")


@pytest.mark.slow
def test_qeval_sensitivity_shows_the_ranking_the_search_made(sensitivity_read_back, pipeline_run):
    """`qeval sensitivity` in a copy of the session's pipeline run, whose search ranked ref-small's layer groups
    (the sensitivity stage, run in that process): the command reads the stage back and prints it; it refuses a
    precision that quantizes nothing and one that does not exist."""
    from helpers import last_json_line

    done = sensitivity_read_back[("--json",)]
    assert done.returncode == 0 and "unchanged, skipped" in done.stderr, done.stderr[-2000:]  # the search's
    got = last_json_line(done.stdout)
    search = pipeline_run.doc["search"]
    assert [got[k] for k in ("frontier", "top_half_kl", "bottom_half_kl")] == [
        search[k] for k in ("frontier", "top_half_kl", "bottom_half_kl")
    ]
    assert (got["precision"], got["fallback"]) == ("gptq", "int8")
    kl = [g["kl"] for g in got["ranked"]]
    assert len(kl) == 6 * 4 and kl == sorted(kl, reverse=True) and kl[-1] > 0  # six layers, four groups each
    assert {len(g["modules"]) for g in got["ranked"]} == {1, 2, 3}  # q/k/v and gate/up share their format
    assert got["top_half_kl"] > got["bottom_half_kl"] > 0
    assert got["tokens"] == 4 * 64  # the card's 4 samples (tests/conftest.py, SMALL), each cut at 64 tokens
    # the frontier: keeping more groups at int8 costs bytes; the ends are the uniform builds
    frontier = got["frontier"]
    assert [c["precision"] for c in frontier[:2]] == ["gptq", "gptq+1xint8"] and frontier[-1]["precision"] == "int8"
    assert all(a["weight_bytes"] < b["weight_bytes"] for a, b in itertools.pairwise(frontier))
    assert frontier[0]["effective_bits"] > 4 and frontier[-1]["effective_bits"] == 8  # scales: 16 bits per 128
    assert frontier[0]["predicted_kl"] > frontier[-1]["predicted_kl"] > 0
    assert "the least sensitive half" in done.stdout and got["ranked"][0]["group"] in done.stdout
    for precision, says in (("bf16", "quantizes no weights of its own"), ("nope", "nope")):
        bad = sensitivity_read_back[("--precision", precision)]
        assert bad.returncode == 2 and says in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_the_predicted_frontier_runs_from_the_uniform_target_to_the_uniform_fallback(tiny):
    from quant.sensitivity import _logits, frontier, quantized_kl

    model, batches = tiny
    groups = layer_groups(model, ["lm_head"])
    gptq, int8 = weight_args("gptq", 128, ["lm_head"]), weight_args("int8", 128, ["lm_head"])
    ranked = rank(model, groups, gptq, batches)
    kept_bf16 = frontier(model, ranked, gptq, None, batches, [0, 3, 8])
    everything = quantized_kl(model, groups, gptq, batches, _logits(model, batches))
    assert kept_bf16[0] == pytest.approx(everything) and kept_bf16[0] > kept_bf16[3] > 0
    assert kept_bf16[8] == pytest.approx(0, abs=1e-9)  # every group kept at the baseline's weights
    kept_int8 = frontier(model, ranked, gptq, int8, batches, [8])
    assert 0 < kept_int8[8] < kept_bf16[0]  # all at INT8: a divergence, smaller than all at 4 bits


def test_a_card_that_ignores_every_layer_has_no_ranking(workdir, cards):
    """Issue 67: `quantization.ignore: ["re:.*"]` had `qeval sensitivity` mark done a ranking of no layer group."""
    from memory_tracker import MemoryTracker

    from pipelines.core.card.cards import load_card
    from pipelines.core.store.manifests import finished
    from pipelines.core.store.results.ranked import Ranked
    from pipelines.core.system.errors import QevalError
    from pipelines.stages.sensitivity import sensitivity

    text = (Path(__file__).parents[1] / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", "name: bad")
    cards("bad", text.replace("search:\n", 'quantization:\n  ignore: ["re:.*"]\nsearch:\n', 1))
    card = load_card("bad")
    with pytest.raises(QevalError, match=r"leaves none of the model's layers to quantize, so there is no layer group"):
        sensitivity(card, "gptq", MemoryTracker("bad"), samples=2)
    assert finished("bad", "gptq", Ranked) is None
