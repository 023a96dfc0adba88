"""The engine benchmark on the reference model, for real, with a tiny grid."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lanes
import pytest
from helpers import REPO
from memory_tracker import MemoryTracker
from mlflow.tracking import MlflowClient

from pipelines.core.system.errors import QevalError
from pipelines.stages.bench import bench
from pipelines.tracking.mlflow_tracker import MlflowTracker
from pipelines.tracking.store import tracking_uri

pytestmark = pytest.mark.slow


@pytest.fixture
def benched(measured):
    return {p: measured["bench"][p] for p in ("bf16", "gptq")}


def test_figures_are_consistent(benched):
    for precision, record in benched.items():
        rows = list(csv.DictReader((record.path / "grid.csv").open()))
        assert [int(r["batch"]) for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
        for r in rows:
            words = ("precision", "device", "kernels", "status", "compile_error")
            f = {k: float(v) for k, v in r.items() if k not in words}
            assert f["decode_tps_total"] == pytest.approx(f["decode_tps_per_user"] * f["batch"])
            assert 0 < f["ttft_ms_p50"] < f["e2e_ms_p50"] and f["repeats"] == 3
            assert f["ttft_ms_p50"] <= f["ttft_ms_p90"] and f["e2e_ms_p50"] <= f["e2e_ms_p90"]
            assert 0 < f["mbu"] < 1
        assert float(rows[1]["peak_mem_bytes"]) >= float(rows[0]["peak_mem_bytes"])
        e = record.result.engine
        assert e.kernels == ("native" if precision == "bf16" else "emulated (weights dequantized to bfloat16)")
        assert e.embedding_bytes == 4096 * 256 * 2  # ref-lm's untied input table: indexed, not read, per step
        assert e.bandwidth_gb_s > 0 and "measured" in e.bandwidth_source
        assert [p.batch for p in record.result.main_points()] == [1, 2]


def test_mlflow_gets_speed_against_batch(own_root):
    from pipelines.core.card.cards import load_card

    card = load_card("ref-small")
    tracker = MlflowTracker(card.name)
    records = {p: bench(card, p, tracker) for p in ("bf16", "gptq")}  # done: logged to the fresh store
    assert {r.status for r in records.values()} == {"skipped"}
    client = MlflowClient(tracking_uri())
    history = client.get_metric_history(records["bf16"].run_id, "engine/decode_tps")
    assert sorted(m.step for m in history) == [1, 2]
    assert {m.value for m in history} == {p.decode_tps_per_user for p in records["bf16"].result.main_points()}
    run = client.get_run(records["gptq"].run_id)
    assert run.data.params["engine.kernels"].startswith("emulated")
    assert run.data.params["engine.input_len"] == "32" and "mem/weights_gb" in run.data.metrics
    assert run.data.params["engine.repeats"] == "3" and run.data.params["engine.seed"] == "0"
    assert "bench/grid.csv" in {a.path for a in client.list_artifacts(records["gptq"].run_id, "bench")}


def test_speedup_is_checked_against_the_resident_bytes(benched):
    up, base = benched["gptq"].result.speedup, benched["bf16"].result
    assert benched["bf16"].result.speedup is None
    assert up.byte_ratio_vs_baseline == pytest.approx(
        base.engine.weight_bytes / benched["gptq"].result.engine.weight_bytes
    )
    # transformers decompresses the packed 4-bit weights at the first forward and reads them in 16 bits at
    # every step after it: the resident bytes are the baseline's, scales aside (issue 39)
    assert 0.97 < up.byte_ratio_vs_baseline < 1.0
    assert up.speedup_suspect == (up.speedup_vs_baseline > 1.15 * up.byte_ratio_vs_baseline)
    assert up.same_engine_as_baseline  # both eager with a dynamic cache on a CPU


def test_no_weights_measures_a_shape_without_a_checkpoint(tmp_path):
    import json

    from eval.bench.engine import EngineConfig, bench_engine

    shape = json.loads((REPO / "pipelines/models/configs/llama-2-7b.json").read_text())
    shape.update(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4
    )
    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = EngineConfig(
        checkpoint=str(tmp_path),
        precision="bf16",
        no_weights=True,
        batch_sizes=[1],
        input_lengths=[16],
        output_lengths=[4],
        warmup=1,
        repeats=2,
    )
    result = bench_engine(cfg, tmp_path)
    assert result.no_weights and result.chars_per_token is None
    assert result.kv_bytes_per_token == 2 * 2 * 4 * 64 * 2
    # 2 layers of (4 x 256^2 attention + 3 x 256 x 512 MLP) + 2 x 32000 x 256 embeddings, + 5 norms, in bf16
    params = 2 * (4 * 256 * 256 + 3 * 256 * 512) + 2 * 32000 * 256 + 5 * 256
    assert result.weight_bytes >= 2 * params and result.points[0].status == "ok"
    assert result.embedding_bytes == 32000 * 256 * 2 and result.execution == "native"  # Llama 2's table is untied


def _compiled_decode(folder: Path, env: dict[str, str], session: Path) -> dict:
    """The engine benchmark with decode compiled, of bf16 and of the session's gptq build, each in a child
    process as a stage runs it: compiling is most of it, beside the tests (tests/lanes.py)."""
    from eval.bench.engine import EngineConfig, bench_engine
    from pipelines.core.system.child import run_child

    checkpoints = {"bf16": REPO / "refmodel/ref-lm", "gptq": session / "artifacts/ref-small/gptq/quantize/checkpoint"}
    results = {}
    for precision, checkpoint in checkpoints.items():
        cfg = EngineConfig(
            checkpoint=str(checkpoint),
            precision=precision,
            batch_sizes=[2],
            input_lengths=[16],
            output_lengths=[8],
            warmup=0,
            repeats=2,
            compile=True,
        )
        out = folder / precision
        # a fresh child: the warm Python (pipelines/core/system/warm.py) is for the test process's main thread
        results[precision] = run_child(bench_engine, cfg, out, folder / f"{precision}.log", env, python=sys.executable)
    return results


compiled_decode = lanes.side_job("compiled_decode", _compiled_decode, after="builds")


def test_compiled_decode_runs_and_a_build_that_cannot_compile_says_why(compiled_decode):
    """The GPU path (static cache, decode compiled by torch.compile) on CPU, where it is opt-in."""
    bf16, gptq = compiled_decode["bf16"], compiled_decode["gptq"]
    assert bf16.engine.endswith("static cache, decode compiled") and bf16.compile_error is None
    # compressed-tensors' packed layers do not trace: the build is measured eager, and it says why
    assert gptq.engine.endswith("static cache, eager") and gptq.compile_error
    for r in compiled_decode.values():
        (p,) = r.points
        assert p.status == "ok" and p.repeats == 2 and 0 < p.ttft_ms_p50 < p.e2e_ms_p50 and 0 < p.mbu < 1


def test_no_weights_from_the_card_is_labelled_as_such(small_root, workdir, monkeypatch):
    from pipelines.core.card.cards import load_card

    monkeypatch.setenv("QEVAL_CARDS_DIR", str(small_root / "cards"))  # the small card, an empty work folder
    card = load_card("ref-small")
    tracker = MemoryTracker(card.name)
    record = bench(card, "bf16", tracker, no_weights=True)
    assert record.result.engine.no_weights is True and record.result.engine.chars_per_token is None
    assert tracker.run("bf16").params["engine.weights"] == "random (no_weights)"
    with pytest.raises(QevalError, match="--no-weights measures the bf16 baseline only"):
        bench(card, "gptq", tracker, no_weights=True)


def test_shipped_architecture_of_a_real_card_matches_published_kv_size():
    from transformers import AutoConfig

    from eval.devices.sizing import Shape
    from pipelines.core.card.cards import load_card
    from pipelines.core.system.paths import resolve_repo_path

    card = load_card("llama-3.1-8b-instruct")
    c = AutoConfig.from_pretrained(resolve_repo_path(card.source.config))
    assert Shape.from_config(c.to_dict()).kv_bytes_per_token() == 128 * 1024  # Llama 3 8B, bf16: 128 KiB
