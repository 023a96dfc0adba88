"""`qeval run` as `make run` uses it: every stage for every build, the gate and the report, then a rerun
that skips every build stage. The run itself is the session's `pipeline_run` (tests/conftest.py); each test
here reads one part of what it left."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import last_json_line, processes_naming, qeval, root_env
from mlflow.tracking import MlflowClient

from conftest import SERVED
from eval.load.serving import read_csv
from pipelines.core.card.cards import load_card
from pipelines.core.store.searches import with_carried
from pipelines.core.store.verdicts import Decision
from pipelines.present.shipcard import ship_card
from pipelines.stages.engines import kv_cannot_serve, vllm_cannot_run, vllm_dtype
from pipelines.tracking.store import tracking_uri
from quant.execution import CPU

pytestmark = pytest.mark.slow

PRECISIONS = list(SERVED)  # ref-lm's builds but awq and, without AMX, fp8 (tests/conftest.py, pipeline_run)
BUILD_STAGES = ("quantize", "evaluate", "bench", "size", "serve")


def _record(run, stage: str, precision: str) -> dict:
    return next(s for s in run.doc["stages"] if (s["stage"], s["precision"]) == (stage, precision))


def _result(run, stage: str, precision: str) -> dict:
    return _record(run, stage, precision)["result"]


def _report(run) -> str:
    return next(Path(p) for p in run.doc["report"] if p.endswith("report.md")).read_text()


def test_run_does_every_stage_in_order_and_says_how_long_each_took(pipeline_run):
    doc = pipeline_run.doc
    mix = doc["search"]["carried"]  # the mixed build the card's search built (test_the_search_...)
    # the gate decided (exit 1 exactly when nothing ships)
    assert (pipeline_run.returncode == 0) == (doc["gate"]["chosen"] is not None)
    assert {b["precision"] for b in doc["gate"]["builds"]} == set(PRECISIONS) - {"bf16"} | {mix}
    assert doc["gate"]["speed_axis"].startswith("goodput")  # judged as served
    assert [(s["stage"], s["precision"]) for s in doc["stages"]] == [
        *((st, p) for st in BUILD_STAGES for p in PRECISIONS),
        *((st, mix) for st in BUILD_STAGES),  # after the uniform builds' stages and the search
    ]
    statuses = {(s["stage"], s["precision"] == mix): s["status"] for s in doc["stages"]}
    assert statuses == {
        **{(st, False): "skipped" for st in ("quantize", "evaluate", "bench", "size")},  # the fixtures'
        ("serve", False): "done",
        **{(st, True): "skipped" for st in ("quantize", "evaluate")},  # the search built and evaluated it
        **{(st, True): "done" for st in ("bench", "size", "serve")},
    }
    # its time by stage, this run's wall time: the cached stages' checks, the served ones' whole work
    seconds = doc["seconds"]
    assert list(seconds) == [*BUILD_STAGES, "search", "gate", "report", "total"]
    assert seconds["serve"] > seconds["quantize"] and seconds["serve"] > 10
    assert sum(v for k, v in seconds.items() if k != "total") <= seconds["total"] + 0.5


def test_the_report_prices_measured_and_projected_capacity_and_shows_generated_text(pipeline_run):
    names = sorted(Path(p).name for p in pipeline_run.doc["report"])
    assert ("ship_card.md" in names) == (pipeline_run.doc["gate"]["chosen"] is not None)
    assert [n for n in names if n != "ship_card.md"] == [
        "agreement_refkjv_continue.png",
        "frontier.png",
        "latency_vs_users.png",
        "memory.png",
        "quality_vs_cost.png",
        "quality_vs_speed.png",
        "quality_vs_weights.png",
        "report.md",
        "sensitivity.png",
        "speed_vs_batch.png",
    ]
    assert all(Path(p).stat().st_size > 1000 for p in pipeline_run.doc["report"])
    # the card's traffic (ref-lm's: 64 users) priced on this CPU, measured, and on its GPUs, projected
    report = _report(pipeline_run)
    capacity = report.split("## Capacity and cost: 64 concurrent users at peak, scenario default")[1]
    assert (
        "| build | verdict | worst recovery | cpu | h100-sxm | l4 | crossover (output tokens/s against the baseline's"
        in capacity
    )
    # measured: "(measured)", or "(measured; none missed, stopped at ...)" where the search past the grid found
    # no edge (ref-small meets the objective at every level it is raised to, up to the generator's ceiling)
    assert "(measured" in capacity and "(projected)" in capacity and "per 1M output tokens" in capacity
    assert "2-byte KV entries (1-byte for int8+kv-fp8)" in report  # the fits table's assumptions, per build
    # every served build at the card's 40 tokens/s per user, priced where its frontier brackets that speed
    at_speed = report.split("### At 40 output tokens/s per user (matched interactivity)")[1].split("\n## ")[0]
    assert all(f"| {b} | cpu | " in at_speed for b in PRECISIONS if _result(pipeline_run, "serve", b)["vllm"])
    # the gate judges cost on the card's first GPU, projected: no frontier there, so each build's edge, said so
    costs = [b["speed"]["cost"] for b in pipeline_run.doc["gate"]["builds"]]
    assert costs and all("no sweep on h100-sxm, its edge judged" in c["at_speed_why"] for c in costs)
    needs = report.split("## Documents each verdict needs")[1]  # what sizes the card's tasks
    assert all(f"| {b} | refkjv_ppl | " in needs for b in PRECISIONS[1:])
    # the generative task: output length and greedy departures per build; the needle judged by its gain
    generated = report.split("## Generated text against the baseline's, same documents (greedy)")[1]
    assert all(f"| {b} | refkjv_continue | chrf " in generated for b in PRECISIONS[1:])
    for b in pipeline_run.doc["gate"]["builds"]:
        g = b["generation"]["refkjv_continue"]
        assert g["length"]["n"] == 6 and len(g["departures"]["positions"]) == 6
        assert any(r["name"] == "refkjv_continue length" for r in b["rules"])
        # the multiple-choice tasks' changed answers, beside their recovery; none for the others
        assert set(b["flips"]) == {"refkjv_next_verse", "refkjv_last_word"}
        assert all(f["n"] == 6 and 0 <= f["flipped"] <= 6 for f in b["flips"].values())
        assert b["tasks"]["refkjv_needle"]["metric"] == "log-likelihood gain over refkjv_needle_control"
    changed = report.split("## Answers that changed, same documents")[1]
    assert all(f"| {b} | refkjv_last_word | acc " in changed for b in PRECISIONS[1:])
    assert all(f"| {b} | refkjv_next_verse | acc_norm " in changed for b in PRECISIONS[1:])
    size = _result(pipeline_run, "size", "gptq")
    assert isinstance(size["weights_bytes"], float) and {f["gpu"] for f in size["fits"]} == {"h100-sxm", "l4"}


def test_the_search_ranks_the_layers_builds_one_mix_proves_it_and_serves_it_with_both_kernels(
    pipeline_run, pipeline_root
):
    found = pipeline_run.doc["search"]
    mix = found["carried"]
    assert (found["target"], found["fallback"], found["groups"]) == ("gptq", "int8", 24)  # 6 layers, 4 groups each
    assert found["top_half_kl"] > found["bottom_half_kl"] > 0
    frontier = found["frontier"]  # predicted before anything was built, from none kept to all
    assert [c["kept"] for c in frontier] == list(range(25))
    assert (frontier[0]["precision"], frontier[-1]["precision"]) == ("gptq", "int8")
    assert [c["weight_bytes"] for c in frontier] == sorted(c["weight_bytes"] for c in frontier)
    assert frontier[0]["predicted_kl"] > frontier[-1]["predicted_kl"] > 0
    assert {t["precision"] for t in found["uniform"]} == set(PRECISIONS) - {"bf16"}
    (tried,) = found["tried"]  # the card allows one evaluation
    assert tried["precision"] == mix == f"gptq+{found['first']}xint8" and 0 < found["first"] < 24
    assert found["chosen"] in (None, mix) and found["why"]
    gated = next(b for b in pipeline_run.doc["gate"]["builds"] if b["precision"] == mix)
    assert tried["verdict"] == gated["verdict"]  # the search's judge is the gate's quality rules
    # a real compressed-tensors checkpoint with two schemes, proven layer by layer; its real bytes in between
    q = _result(pipeline_run, "quantize", mix)
    assert q["proof"]["format"] == "mixed-precision"
    layers = q["proof"]["layers"]
    assert set(layers) == {"pack-quantized", "int-quantized"} and sum(layers.values()) == 6 * 7
    sizes = {p: _result(pipeline_run, "quantize", p)["checkpoint_bytes"] for p in ("gptq", "int8")}
    assert sizes["gptq"] < q["checkpoint_bytes"] == tried["weight_bytes"] < sizes["int8"]
    served = _result(pipeline_run, "serve", mix)
    if vllm_cannot_run(mix, CPU, dtype=vllm_dtype(CPU)):
        assert served["engine"] == "transformers"
    else:  # one kernel per format, each labelled by how it runs here
        assert served["engine"] == "vllm" and served["execution"] == "mixed"
        assert sorted(k["execution"] for k in served["kernels"]) == ["native", "weight-only"]
    report = _report(pipeline_run)
    section = report.split("## Mixed precision: gptq with its most sensitive layer groups at int8")[1]
    assert f"| {found['first']} | {mix} | " in section and "| 0 | gptq | " in section and "| 24 | int8 | " in section
    ranked = pipeline_run.root / "artifacts/ref-small/gptq/sensitivity"
    assert (ranked / "sensitivity.json").is_file() and not (ranked / "sensitivity.png").exists()  # data, not a chart
    # the report draws the ranking, on the summary run and the target's own run
    target_run = _record(pipeline_run, "quantize", "gptq")["run_id"]
    logged = MlflowClient(tracking_uri()).list_artifacts(target_run, "report")
    assert "report/sensitivity.png" in [a.path for a in logged]
    # were it to ship, its ship card lists its layers at each precision and the groups kept, most sensitive first
    card = with_carried(load_card("ref-small"))
    assert mix in card.precisions  # what `qeval gate` and `qeval report` read again
    shipped = Decision.model_validate(pipeline_run.doc["gate"]).model_copy(update={"chosen": mix})
    layers = ship_card(card, shipped).split("## Layers at each precision")[1].split("##")[0]
    kept = found["first"]
    assert f"- {len(q['config']['target_modules'])} linear layers at gptq" in layers
    assert f"Kept at int8: the {kept} of 24 layer groups" in layers and layers.count("nats per token alone") == kept


def test_the_kv_cache_variant_shares_int8s_weights_with_half_the_kv_cache(pipeline_run):
    assert (
        _result(pipeline_run, "quantize", "int8+kv-fp8")["checkpoint"]
        == _result(pipeline_run, "quantize", "int8")["checkpoint"]
    )
    assert _result(pipeline_run, "evaluate", "int8+kv-fp8")["config"]["kv_cache_dtype"] == "fp8"
    assert _result(pipeline_run, "evaluate", "int8")["config"]["kv_cache_dtype"] == "auto"
    assert _result(pipeline_run, "bench", "int8+kv-fp8")["engine"]["engine"].endswith("FP8 KV cache emulated")
    sized = {p: _result(pipeline_run, "size", p) for p in ("int8", "int8+kv-fp8")}  # the same weights
    assert sized["int8+kv-fp8"]["weights_bytes"] == sized["int8"]["weights_bytes"]
    assert 2 * sized["int8+kv-fp8"]["kv_bytes_per_token"] == sized["int8"]["kv_bytes_per_token"]


def test_every_build_is_served_on_vllm_labelled_by_its_kernel_and_scored_through_its_server(pipeline_run):
    served = {p: _result(pipeline_run, "serve", p) for p in PRECISIONS}
    # vLLM's 4-bit CPU kernel needs AVX-512 and a 16-bit dtype: without them the 4-bit builds are served by
    # transformers, dequantized
    cannot = vllm_cannot_run("gptq", CPU, dtype=vllm_dtype(CPU))
    fourbit = ("transformers", "emulated") if cannot else ("vllm", "weight-only")
    # the KV-cache variant: int8's checkpoint with vLLM's FP8 KV cache, which its CPU attention keeps with AVX-512
    unserved = kv_cannot_serve("fp8", "vllm", CPU)
    expected = {
        "bf16": ("vllm", "native"),
        "int8": ("vllm", "native"),
        "gptq": fourbit,
        "int8+kv-fp8": ("vllm", "unknown" if unserved else "native"),
    }
    if "fp8" in served:  # served with torch's oneDNN off, on a CPU with AMX-INT8 (tests/conftest.py, SERVED)
        expected["fp8"] = ("vllm", "emulated")
        assert served["fp8"]["vllm"]["torch_onednn"] is False
    assert {p: (r["engine"], r["execution"]) for p, r in served.items()} == expected
    variant = served.pop("int8+kv-fp8")
    if unserved:  # recorded with the reason, holding no users; nothing swept or scored
        assert variant["not_run"].startswith(unserved) and variant["per_level"] == {} and variant["accuracy"] is None
        assert f"- int8+kv-fp8: NOT SERVED: {unserved}" in _report(pipeline_run)
    else:
        assert variant["vllm"]["kv_cache_dtype"] == "fp8" and variant["per_level"]
        served["int8+kv-fp8"] = variant
    tasks = set(load_card("ref-lm").accuracy.tasks)
    for p, r in served.items():
        if r["engine"] != "vllm":  # served accuracy needs vLLM's prompt log-probabilities, and says so
            assert r["accuracy"] is None and r["not_run"].startswith("served accuracy"), p
            continue
        assert set(r["accuracy"]["vs_offline"]) == tasks, p
        assert isinstance(r["accuracy"]["vs_offline"]["refkjv_continue"]["identical"], int), p
        assert all(abs(c["served"] - c["offline"]) < 0.2 for c in r["accuracy"]["vs_offline"].values()), p
        # each level judged on its p95s' intervals, and the server's own view of it (its /metrics)
        lo, hi = r["users_at_slo_interval"]
        assert lo <= hi and lo <= r["max_users_at_slo"] <= hi, p
        for c, m in r["per_level"].items():
            assert m["slo_verdict"] in ("PASS", "FAIL", "INCONCLUSIVE"), (p, c)
            low, high = m["ttft_ms_p95_interval"]
            assert low <= m["ttft_ms_p95"] <= high, (p, c)
            assert m["server"]["finished"] == m["requests"] and m["server"]["ttft_ms_mean"] > 0, (p, c)


def test_int8_is_served_natively_streamed_stopped_and_scored_as_offline(pipeline_run, pipeline_root):
    """One build's server record in detail: vLLM's native INT8 kernel, every request streamed to its length,
    nothing left running, and the same documents scored through the server and offline."""
    record = _record(pipeline_run, "serve", "int8")
    s, path = record["result"], Path(record["path"])
    assert s["engine_version"].startswith("vllm")
    assert [(k["kernel"], k["execution"]) for k in s["kernels"]] == [("CPUInt8ScaledMMLinearKernel", "native")]
    assert s["vllm"]["enforce_eager"] and s["vllm"]["max_model_len"] == 514
    records = read_csv(path / "requests.csv")
    asked = sum(m["requests"] for m in s["per_level"].values())  # the grid's 6, and any rounds server.edge added
    assert len(records) == asked >= 6 and all(r.ok for r in records), [r.error for r in records if not r.ok]
    assert {r.output_tokens for r in records} == {8} and s["load"]["exact_length"] == "ignore_eos"
    assert all(len(r.token_times) >= 2 and r.start < r.first_token <= r.end for r in records)  # streamed
    # stopped with everything it started: no server, engine core or worker left
    assert processes_naming(str(path.parent / "quantize" / "checkpoint")) == []
    # lm-eval's completions backend sends the offline token windows, so the difference is the engine's alone
    acc = s["accuracy"]
    assert acc["config"]["backend"] == "local-completions" and acc["config"]["limit"] == 6
    ppl = acc["vs_offline"]["refkjv_ppl"]
    est, lo, hi = ppl["difference"]
    assert ppl["metric"] == "bits_per_byte" and ppl["n"] > 0 and abs(est) < 0.01 and lo <= est <= hi
    for task in ("refkjv_next_verse", "refkjv_last_word"):
        c = acc["vs_offline"][task]
        assert c["n"] == 6 and abs(c["served"] - c["offline"]) <= 1 / 6 + 1e-9  # at most one document flips
    assert (path / "served_accuracy" / "samples_refkjv_ppl.jsonl").is_file()
    data = MlflowClient(tracking_uri()).get_run(record["run_id"]).data
    assert data.params["server.kernels"] == "CPUInt8ScaledMMLinearKernel"
    assert data.params["server.execution"] == "native" and data.params["server.engine"] == "vllm"
    assert data.metrics["served_vs_offline/refkjv_ppl/bits_per_byte"] == pytest.approx(est)
    assert "served/refkjv_last_word/acc" in data.metrics
    # the report's throughput-interactivity frontier on the build's own run, as the summary run has it
    logged = [a.path for a in MlflowClient(tracking_uri()).list_artifacts(record["run_id"], "report")]
    assert "report/frontier.png" in logged, logged


def test_a_generative_task_runs_greedily_through_the_server_as_offline(pipeline_run):
    """refkjv_continue through vLLM's completions API (lm-eval's local-completions backend) and offline, the
    baseline on the same documents: the served generations stop at the line's end, are scored per document,
    and are mostly the offline ones, word for word (both greedy, in one dtype; a prompt off by one token
    would make every one differ)."""
    import eval.quality.paired
    from eval.quality.records import AccuracyResult

    served = _record(pipeline_run, "serve", "bf16")
    offline = _record(pipeline_run, "evaluate", "bf16")
    if served["result"]["engine"] != "vllm":
        pytest.skip(f"bf16 was not served on vLLM here: {served['result']['not_run']}")
    folders = {"offline": Path(offline["path"]), "served": Path(served["path"]) / "served_accuracy"}

    def generated(side: str) -> dict[int, str]:
        rows = (folders[side] / "samples_refkjv_continue.jsonl").read_text().splitlines()
        return {r["doc_id"]: r["filtered_resps"][0] for r in map(json.loads, rows)}

    served_text, offline_text = generated("served"), generated("offline")
    assert served_text.keys() == offline_text.keys() and len(served_text) == 6
    assert all(t.strip() and "\n" not in t for t in served_text.values())
    same = sum(served_text[d] == offline_text[d] for d in served_text)
    assert same >= 4, (same, served_text, offline_text)
    # the paired reading the gate and the serve stage use: served against offline, in generated tokens
    results = {"offline": offline["result"]["accuracy"], "served": served["result"]["accuracy"]["accuracy"]}
    both = [
        eval.quality.paired.Scored(folders[k], AccuracyResult.model_validate(results[k])) for k in ("offline", "served")
    ]
    g = eval.quality.paired.generation("refkjv_continue", *both, band=0.1, bootstrap=load_card("ref-lm").gate.bootstrap)
    assert g.departures.identical == same and g.length.n == 6
    assert served["result"]["accuracy"]["vs_offline"]["refkjv_continue"]["identical"] == same


def test_qeval_card_reads_back_what_the_gate_decided(pipeline_run):
    """The ship card, read back from the store, names the build the gate chose; where nothing shipped (the
    usual case on ref-small's few documents), `qeval card` says so in one line, exit 2. tests/test_gate.py
    reads a shipped build's card in full."""
    chosen = pipeline_run.doc["gate"]["chosen"]
    shown = qeval("card", "--model", "ref-small", env=root_env(pipeline_run.root), timeout=120)
    if chosen is None:
        assert shown.returncode == 2 and shown.stdout == "", shown.stdout[-2000:]
        assert (
            shown.stderr.strip()
            .splitlines()[-1]
            .endswith("nothing ships for ref-small in the tracking store; run: qeval gate --model ref-small")
        )
    else:
        assert shown.returncode == 0 and shown.stdout.startswith(f"# ref-small {chosen}: the build qeval ships")
        assert "## Capacity and cost" in shown.stdout and "## Speed, as measured" in shown.stdout


def test_a_rerun_skips_every_build_stage(pipeline_run):
    """Runs again in the session's pipeline folder: the gate and the report are written again, the same."""
    env = root_env(pipeline_run.root)
    t0 = time.perf_counter()
    again = qeval("run", "--model", "ref-small", "--json", env=env, timeout=300)
    assert again.returncode == pipeline_run.returncode and time.perf_counter() - t0 < 60, again.stderr[-2000:]
    doc = last_json_line(again.stdout)
    assert {s["status"] for s in doc["stages"]} == {"skipped"}
    assert doc["gate"]["chosen"] == pipeline_run.doc["gate"]["chosen"]
