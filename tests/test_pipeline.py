"""`qeval run` as `make run` uses it: every stage for every build, the gate and the report, then a rerun
that skips every build stage."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import last_json_line, qeval, root_env

from pipelines.stages.engines import kv_cannot_serve, vllm_cannot_run
from quant.execution import CPU

pytestmark = pytest.mark.slow


def test_run_does_every_stage_then_skips_them(own_root):
    card = own_root / "cards" / "ref-small.yaml"
    card.write_text(card.read_text().replace("speed_regime: engine", "speed_regime: server"))  # as ref-lm's
    env = root_env(own_root)
    args = ["run", "--model", "ref-small", "--json"]
    # six builds served, each scored through its server too: on a 2-core Xeon with AMX this test took 17 min 43 s,
    # about 6 of them the session's builds
    first = qeval(*args, env=env, timeout=1500)
    assert first.returncode in (0, 1) and first.stdout.strip(), first.stderr[-2000:]
    doc = last_json_line(first.stdout)
    stages = doc["stages"]
    # the gate decided (exit 1 exactly when nothing ships) and the report was written
    assert (first.returncode == 0) == (doc["gate"]["chosen"] is not None)
    assert {b["precision"] for b in doc["gate"]["builds"]} == {"fp8", "int8", "awq", "gptq", "int8+kv-fp8"}
    assert doc["gate"]["speed_axis"].startswith("goodput")  # judged as served
    names = sorted(Path(p).name for p in doc["report"])
    assert ("ship_card.md" in names) == (doc["gate"]["chosen"] is not None)
    assert [n for n in names if n != "ship_card.md"] == [
        "agreement_refkjv_continue.png",
        "latency_vs_users.png",
        "memory.png",
        "quality_vs_cost.png",
        "quality_vs_speed.png",
        "quality_vs_weights.png",
        "report.md",
        "speed_vs_batch.png",
    ]
    assert all(Path(p).stat().st_size > 1000 for p in doc["report"])
    # the card's traffic (ref-lm's: 64 users) priced on this CPU, measured, and on its GPUs, projected
    report = next(Path(p) for p in doc["report"] if p.endswith("report.md")).read_text()
    capacity = report.split("## Capacity and cost: 64 concurrent users at peak, scenario default")[1]
    assert "| build | verdict | worst recovery | cpu | h100-sxm | l4 | crossover |" in capacity
    assert "(measured)" in capacity and "(projected)" in capacity and "per 1M output tokens" in capacity
    assert "2-byte KV entries (1-byte for int8+kv-fp8)" in report  # the fits table's assumptions, per build
    # the generative task: output length and greedy departures per build; the needle judged by its gain
    generated = report.split("## Generated text against the baseline's, same documents (greedy)")[1]
    assert all(f"| {b} | refkjv_continue | chrf " in generated for b in ("fp8", "int8", "awq", "gptq", "int8+kv-fp8"))
    for b in doc["gate"]["builds"]:
        g = b["generation"]["refkjv_continue"]
        assert g["length"]["n"] == 6 and len(g["departures"]["positions"]) == 6
        assert any(r["name"] == "refkjv_continue length" for r in b["rules"])
        assert b["tasks"]["refkjv_needle"]["metric"] == "log-likelihood gain over refkjv_needle_control"
    precisions = ["bf16", "fp8", "int8", "awq", "gptq", "int8+kv-fp8"]
    assert [(s["stage"], s["precision"]) for s in stages] == [
        (stage, p) for stage in ("quantize", "evaluate", "bench", "size", "serve") for p in precisions
    ]
    assert {s["status"] for s in stages if s["stage"] in ("quantize", "evaluate", "bench")} == {"skipped"}  # fixtures
    assert {s["status"] for s in stages if s["stage"] in ("serve", "size")} == {"done"}
    # every build served on vLLM, labelled by the kernel vLLM reported, and scored through its server too
    served = {s["precision"]: s["result"] for s in stages if s["stage"] == "serve"}
    # vLLM's 4-bit CPU kernel needs AVX-512: without it the 4-bit builds are served by transformers, dequantized
    fourbit = ("transformers", "emulated") if vllm_cannot_run("awq", CPU) else ("vllm", "weight-only")
    # the KV-cache variant: int8's checkpoint with vLLM's FP8 KV cache, which its CPU attention keeps with AVX-512
    unserved = kv_cannot_serve("fp8", "vllm", CPU)
    assert {p: (r["engine"], r["execution"]) for p, r in served.items()} == {
        "bf16": ("vllm", "native"),
        "fp8": ("vllm", "emulated"),
        "int8": ("vllm", "native"),
        "awq": fourbit,
        "gptq": fourbit,
        "int8+kv-fp8": ("vllm", "unknown" if unserved else "native"),
    }
    variant = served.pop("int8+kv-fp8")
    if unserved:  # recorded with the reason, holding no users; nothing swept or scored
        assert variant["not_run"].startswith(unserved) and variant["per_level"] == {} and variant["accuracy"] is None
        assert f"- int8+kv-fp8: NOT SERVED: {unserved}" in report
    else:
        assert variant["vllm"]["kv_cache_dtype"] == "fp8" and variant["per_level"]
        served["int8+kv-fp8"] = variant
    result = {(s["stage"], s["precision"]): s["result"] for s in stages}
    assert result["quantize", "int8+kv-fp8"]["checkpoint"] == result["quantize", "int8"]["checkpoint"]
    assert result["evaluate", "int8+kv-fp8"]["config"]["kv_cache_dtype"] == "fp8"
    assert result["evaluate", "int8"]["config"]["kv_cache_dtype"] == "auto"
    assert result["bench", "int8+kv-fp8"]["engine"]["engine"].endswith("FP8 KV cache emulated")
    sized = {p: result["size", p] for p in ("int8", "int8+kv-fp8")}  # the same weights, half the KV cache
    assert sized["int8+kv-fp8"]["weights_bytes"] == sized["int8"]["weights_bytes"]
    assert 2 * sized["int8+kv-fp8"]["kv_bytes_per_token"] == sized["int8"]["kv_bytes_per_token"]
    for p, r in served.items():
        if r["engine"] != "vllm":  # served accuracy needs vLLM's prompt log-probabilities, and says so
            assert r["accuracy"] is None and r["not_run"].startswith("served accuracy"), p
            continue
        assert set(r["accuracy"]["vs_offline"]) == {
            "refkjv_ppl", "refkjv_next_verse", "refkjv_last_word", "refkjv_continue", "refkjv_needle",
            "refkjv_needle_control",
        }, p  # fmt: skip
        assert isinstance(r["accuracy"]["vs_offline"]["refkjv_continue"]["identical"], int), p
        assert all(abs(c["served"] - c["offline"]) < 0.2 for c in r["accuracy"]["vs_offline"].values()), p
    if chosen := doc["gate"]["chosen"]:  # its ship card, read back from the store, says what the gate decided
        shown = qeval("card", "--model", "ref-small", env=env, timeout=120)
        assert shown.returncode == 0 and shown.stdout.startswith(f"# ref-small {chosen}: the build qeval ships")
        build = next(b for b in doc["gate"]["builds"] if b["precision"] == chosen)
        for task, c in build["tasks"].items():
            rec, lo, hi = c["recovery"]
            assert (
                f"| {task} | {c['metric']} |" in shown.stdout
                and f"| {rec:.4f} | [{lo:.4f}, {hi:.4f}] |" in shown.stdout
            )
        for section in ("## What it is", "## Speed, as measured", "## Capacity and cost", "## Serving it"):
            assert section in shown.stdout, section
        assert all(f"- {r['reason']}" in shown.stdout for r in build["rules"])
    size = next(s for s in stages if s["stage"] == "size" and s["precision"] == "awq")["result"]
    assert isinstance(size["weights_bytes"], float) and {f["gpu"] for f in size["fits"]} == {"h100-sxm", "l4"}
    t0 = time.perf_counter()
    again = qeval(*args, env=env, timeout=300)
    assert again.returncode == first.returncode and time.perf_counter() - t0 < 60
    assert {s["status"] for s in last_json_line(again.stdout)["stages"]} == {"skipped"}
