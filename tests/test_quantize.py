"""Quantization: recipes, calibration, proofs, and a real llm-compressor run for every precision."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from memory_tracker import MemoryTracker
from mlflow.tracking import MlflowClient

from pipelines.core.card.cards import load_card
from pipelines.core.store.manifests import finished
from pipelines.core.store.results import Quantized
from pipelines.core.system.errors import QevalError
from pipelines.stages.quantize import quantize
from pipelines.tracking.mlflow_tracker import MlflowTracker
from pipelines.tracking.store import tracking_uri
from quant.build import misaligned_layers
from quant.calibration import MIN_TOKENS, CalibrationSpec, prepare
from quant.precisions import PRECISIONS, build_recipe, get_precision
from quant.recipes import GROUP_SIZE, IGNORE, RecipeOptions
from quant.verify import check_quantization_config, compare_logits


def test_every_precision_has_a_recipe():
    defaults = RecipeOptions(GROUP_SIZE, list(IGNORE))
    assert build_recipe("bf16", defaults) is None
    for name in PRECISIONS.keys() - {"bf16"}:
        recipe = build_recipe(name, RecipeOptions(group_size=64, ignore=["lm_head", "x"]))
        assert recipe and all(type(m).__name__.endswith("Modifier") for m in recipe)
    gptq = build_recipe("gptq", RecipeOptions(group_size=64, ignore=list(IGNORE)))[0]
    assert gptq.config_groups["group_0"].weights.group_size == 64
    assert gptq.config_groups["group_0"].weights.num_bits == 4 and gptq.ignore == ["lm_head"]
    awq = build_recipe("awq", defaults)
    assert [type(m).__name__ for m in awq] == ["AWQModifier", "QuantizationModifier"]
    assert awq[1].config_groups["group_0"].weights.symmetric is False
    with pytest.raises(ValueError, match="unknown precision"):
        build_recipe("int3", defaults)


def test_misaligned_layers_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(256, 8), torch.nn.Linear(8, 100), torch.nn.Linear(100, 4))
    assert misaligned_layers(model, 128, ignore=[]) == ["1 (8)", "2 (100)"]
    assert misaligned_layers(model, 128, ignore=["2"]) == ["1 (8)"]
    assert misaligned_layers(model, 4, ignore=[]) == []


def test_calibration_drops_empty_and_short_samples():
    spec = CalibrationSpec("d.jsonl", "train", "text", num_samples=2, max_seq_length=20)
    words = lambda t: list(range(len(t.split())))  # noqa: E731 - one token per word
    long = " ".join(["w"] * 30)
    short = " ".join(["w"] * (MIN_TOKENS - 1))
    calib = prepare(spec, ["", "   ", short, long, long, long], words)
    assert len(calib.input_ids) == 2 and calib.dropped == 3
    assert all(len(ids) == 20 for ids in calib.input_ids) and calib.tokens == 40
    assert calib.sha256 == prepare(spec, ["", "   ", short, long, long], words).sha256
    with pytest.raises(ValueError, match=r"has 1 usable samples \(2 dropped .*num_samples asks for 2"):
        prepare(spec, ["", short, long], words)


def _qc(fmt: str, bits: int) -> dict:
    groups = {"group_0": {"weights": {"num_bits": bits}}}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "config_groups": groups}}


def test_quantization_config_must_match_the_precision():
    assert check_quantization_config(_qc("pack-quantized", 4), "gptq") == ("pack-quantized", 4)
    assert check_quantization_config(_qc("float-quantized", 8), "fp8") == ("float-quantized", 8)
    with pytest.raises(ValueError, match="declares format pack-quantized with \\[4\\]-bit weights; expected int"):
        check_quantization_config(_qc("pack-quantized", 4), "int8")
    with pytest.raises(ValueError, match="declares no compressed-tensors"):
        check_quantization_config({}, "awq")


def test_compare_logits():
    base = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    assert compare_logits(base, base.clone()) == (0.0, 1.0, 0.0, 2)
    kl, agree, diff, n = compare_logits(base, torch.tensor([[0.0, 2.0, 0.0], [0.0, 3.0, 0.0]]))
    p, q = torch.softmax(base[0], 0), torch.softmax(torch.tensor([0.0, 2.0, 0.0]), 0)
    assert kl == pytest.approx(float((p * (p / q).log()).sum()) / 2, rel=1e-5)
    assert (agree, diff, n) == (0.5, 2.0, 2)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the upstream failure needs a machine without one")
def test_awq_cpu_workaround_is_still_needed_and_works():
    from llmcompressor.pipelines.cache import IntermediatesCache

    from quant.cpu_awq import skip_pinning_without_accelerator

    cache = IntermediatesCache.from_dataloader([{"x": torch.ones(2)}])
    original = IntermediatesCache.pin_memory
    try:
        with pytest.raises(RuntimeError, match="accelerator"):
            cache.pin_memory(0)  # when this stops failing upstream, drop quant/cpu_awq.py
        assert skip_pinning_without_accelerator()
        cache.pin_memory(0)
        assert torch.equal(cache.fetch(0)["x"], torch.ones(2))
    finally:
        IntermediatesCache.pin_memory = original


@pytest.mark.slow
def test_every_precision_builds_a_real_quantized_checkpoint(builds):
    base_bytes = builds["bf16"].result.checkpoint_bytes
    for name, record in builds.items():
        q = record.result
        if name == "bf16":
            assert q.proof is None and q.source == "refmodel/ref-lm"
            continue
        if shared := get_precision(name).shares:  # a KV-cache variant: its precision's checkpoint, built once
            built = builds[shared].result
            assert (q.checkpoint, q.files, q.proof, q.shares) == (built.checkpoint, built.files, built.proof, shared)
            assert not (record.path / "checkpoint").exists() and q.scheme.endswith("; FP8 KV cache")
            continue
        want = PRECISIONS[name]
        config = json.loads((record.path / "checkpoint" / "config.json").read_text())
        assert check_quantization_config(config, name) == (want.checkpoint_format, want.weight_bits)
        assert (q.proof.format, q.proof.weight_bits) == (want.checkpoint_format, want.weight_bits)
        assert (record.path / "recipe.yaml").is_file() and q.checkpoint == str(record.path / "checkpoint")
        ratio = q.checkpoint_bytes / base_bytes
        # embeddings and lm_head stay 16-bit, so the ratio is above the bits ratio
        assert ratio < (0.75 if want.weight_bits == 8 else 0.6), (name, ratio)
        assert 0 < q.proof.kl_vs_baseline < 1.0
        assert 0.5 < q.proof.top1_agreement < 1.0 or name in ("fp8", "int8")
        if want.needs_calibration:
            assert q.build.calibration_samples == 4
    kl = {p: builds[p].result.proof.kl_vs_baseline for p in ("fp8", "int8", "awq", "gptq")}
    assert max(kl["fp8"], kl["int8"]) < min(kl["awq"], kl["gptq"]), kl  # 8 bits stay closer than 4
    assert builds["awq"].result.build.awq_cpu_workaround is not torch.accelerator.is_available()


@pytest.mark.slow
def test_builds_are_logged_to_mlflow(own_root, builds):
    card = load_card("ref-small")
    tracker = MlflowTracker(card.name)
    client = MlflowClient(tracking_uri())
    for name in card.precisions:
        record = quantize(card, name, tracker)  # finished: logged to the fresh store
        assert record.status == "skipped"
        run = client.get_run(record.run_id)
        assert run.info.run_name == f"ref-small@{name}" and run.data.tags["qeval.stage.quantize"] == "done"
        assert run.data.metrics["size/checkpoint_gb"] == builds[name].result.checkpoint_bytes / 1e9
        if name == "bf16":
            continue
        assert run.data.metrics["quant/kl_vs_baseline"] == builds[name].result.proof.kl_vs_baseline
        if shared := get_precision(name).shares:  # its precision's checkpoint, logged with that one's run
            assert run.data.params["quant.shares"] == shared
            assert not client.list_artifacts(record.run_id, "quantize/checkpoint")
            continue
        assert run.data.params["quant.format"] == PRECISIONS[name].checkpoint_format
        if PRECISIONS[name].needs_calibration:
            assert run.data.params["quant.calibration_samples"] == "4"
        artifacts = {a.path for a in client.list_artifacts(record.run_id, "quantize")}
        assert "quantize/recipe.yaml" in artifacts
        # not the checkpoint, which a store on this machine's disk would hold twice (the gate logs the one that
        # ships, tests/test_gate.py); a store on another machine gets it (tests/test_team.py)
        assert tracker.local_artifacts and not client.list_artifacts(record.run_id, "quantize/checkpoint")


@pytest.mark.slow
def test_second_run_is_skipped(small_card, builds):
    again = quantize(small_card, "gptq", MemoryTracker(small_card.name))
    assert again.status == "skipped" and again.result == builds["gptq"].result


@pytest.mark.slow
def test_group_size_that_does_not_divide_the_widths_is_refused(own_root):
    small = load_card("ref-small")
    card = small.model_copy(update={"quantization": small.quantization.model_copy(update={"group_size": 96})})
    with pytest.raises(QevalError, match=r"input width not divisible by quantization.group_size=96: model\.layers"):
        quantize(card, "gptq", MemoryTracker(card.name), force=True)


@pytest.mark.slow
def test_too_small_calibration_set_is_refused(own_root):
    card = load_card("ref-small")
    with pytest.raises(QevalError, match=r"has 60 usable samples .*calibration.num_samples asks for 500"):
        quantize(card, "gptq", MemoryTracker(card.name), num_samples=500)
    assert (own_root / "artifacts/ref-small/gptq/quantize.failed/stage.log").is_file()
    assert finished("ref-small", "gptq", Quantized) is not None  # the earlier build stays


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MB tmpfs (root only); skipped where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_disk_full_while_saving_is_one_clear_error_and_nothing_is_marked_done(small_card, tiny_disk, monkeypatch):
    monkeypatch.setenv("QEVAL_WORKDIR", str(tiny_disk))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tiny_disk.parent / 'mlflow.db'}")
    with pytest.raises(
        QevalError, match=r"disk full while saving the checkpoint to .*: free space or set QEVAL_WORKDIR"
    ):
        quantize(small_card, "fp8", MemoryTracker(small_card.name))
    assert finished("ref-small", "fp8", Quantized) is None


@pytest.mark.slow
def test_missing_weights_offline_is_one_clear_error(small_card, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    card = small_card.model_copy(
        update={"source": small_card.source.model_copy(update={"path": None, "hub_id": "qeval-test/absent"})}
    )
    with pytest.raises(QevalError, match=r"qeval-test/absent@main are not in the local cache and the hub is off"):
        quantize(card, "fp8", MemoryTracker(card.name))


def test_a_malformed_calibration_line_names_its_file_and_line(tmp_path):
    from quant.calibration import CalibrationSpec, read_texts

    path = tmp_path / "calib.jsonl"
    spec = CalibrationSpec(str(path), "train", "text", 4, 64)
    path.write_text('{"text": "In the beginning"}\n\n{"text": "And the earth\n')
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON \(.*column \d+\)"):
        read_texts(spec)
    path.write_text('{"text": "In the beginning"}\n["a", "list"]\n')
    with pytest.raises(ValueError, match=rf"{path}:2: each line must be a JSON object, not a list"):
        read_texts(spec)
