"""The server benchmark for real, on loopback: vLLM (the engine that ships the builds) and `transformers serve`
(the fallback) on the reference model's builds, and accuracy through vLLM's server against the offline one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, qeval, root_env
from mlflow.tracking import MlflowClient

from eval.serving import read_csv
from pipelines.core.cards import load_card
from pipelines.stages.serve import serve
from pipelines.tracking.mlflow_tracker import MlflowTracker
from pipelines.tracking.store import tracking_uri

pytestmark = pytest.mark.slow


def _on(card, **server):
    return card.model_copy(update={"server": card.server.model_copy(update=server)})


@pytest.fixture
def served(own_root):
    card = _on(load_card("ref-small"), engine="transformers")
    tracker = MlflowTracker(card.name)
    return {p: serve(card, p, tracker) for p in ("bf16", "gptq")}


def _engine_processes(checkpoint: str) -> list[int]:
    """PIDs of live processes whose command line names `checkpoint` (a server and its workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and checkpoint.encode() in cmdline:
            found.append(int(proc.name))
    return found


def test_vllm_serves_a_quantized_build_natively_and_scores_it_as_offline(own_root):
    card = load_card("ref-small")
    assert card.server.engine == "auto" and card.server.served_accuracy  # as ref-lm's card says
    tracker = MlflowTracker(card.name)
    record = serve(card, "int8", tracker)
    s = record.result
    assert s.engine == "vllm" and s.engine_version.startswith("vllm")
    assert [(k.kernel, k.execution) for k in s.kernels] == [("CPUInt8ScaledMMLinearKernel", "native")]
    assert s.execution == "native" and s.vllm.enforce_eager and s.vllm.max_model_len == 514
    records = read_csv(record.path / "requests.csv")
    assert len(records) == 6 and all(r.ok for r in records), [r.error for r in records if not r.ok]
    assert {r.output_tokens for r in records} == {8} and s.load.exact_length == "ignore_eos"
    assert all(len(r.token_times) >= 2 and r.start < r.first_token <= r.end for r in records)  # streamed
    # stopped with everything it started: no server, engine core or worker left
    checkpoint = str(record.path.parent / "quantize" / "checkpoint")
    assert _engine_processes(checkpoint) == []

    # the same documents scored through the server and offline: lm-eval's completions backend sends the
    # offline token windows, so the difference is the engine's alone, and small
    acc = s.accuracy
    assert acc is not None and acc.config.backend == "local-completions" and acc.config.limit == 6
    assert set(acc.vs_offline) == set(card.accuracy.tasks)
    ppl = acc.vs_offline["refkjv_ppl"]
    assert ppl.metric == "bits_per_byte" and ppl.n > 0 and abs(ppl.difference[0]) < 0.01
    assert ppl.difference[1] <= ppl.difference[0] <= ppl.difference[2]
    for task in ("refkjv_next_verse", "refkjv_last_word"):
        c = acc.vs_offline[task]
        assert c.n == 6 and abs(c.served - c.offline) <= 1 / 6 + 1e-9  # at most one document flips
    samples = record.path / "served_accuracy" / "samples_refkjv_ppl.jsonl"
    assert samples.is_file()

    data = MlflowClient(tracking_uri()).get_run(record.run_id).data
    assert data.params["server.kernels"] == "CPUInt8ScaledMMLinearKernel"
    assert data.params["server.execution"] == "native" and data.params["server.engine"] == "vllm"
    assert data.metrics["served_vs_offline/refkjv_ppl/bits_per_byte"] == pytest.approx(ppl.difference[0])
    assert "served/refkjv_last_word/acc" in data.metrics


def test_a_short_sweep_over_a_real_server(served):
    for record in served.values():
        records = read_csv(record.path / "requests.csv")
        assert [(r.concurrency, r.index) for r in records] == [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 3)]
        assert all(r.ok for r in records), [r.error for r in records if not r.ok]
        assert {r.output_tokens for r in records} == {8}  # exactly the card's output length
        assert all(len(r.token_times) >= 2 and r.start < r.first_token <= r.end for r in records)
        assert {r.prompt_tokens for r in records} <= {32, 33}  # 32-token prompts (+ BOS where added)
        assert "Application startup complete" in (record.path / "server.log").read_text()
        s = record.result
        assert s.engine == "transformers" and s.failed_requests == 0 and s.load.exact_length == "generation_config"
        peak = max(m.output_tps for m in s.per_level.values())
        assert s.generator_ceiling.chunks_per_s > 10 * peak and not s.generator_bound  # not the bottleneck
        assert s.max_users_at_slo in (0, 1, 2)
        assert all(m.ttft_ms_p50 <= m.ttft_ms_p90 <= m.ttft_ms_p99 for m in s.per_level.values())

        data = MlflowClient(tracking_uri()).get_run(record.run_id).data
        assert data.params["server.engine"] == "transformers"
        assert data.tags["qeval.stage.serve"] == "done"
        steps = MlflowClient(tracking_uri()).get_metric_history(record.run_id, "server/ttft_ms_p90")
        assert sorted(m.step for m in steps) == [1, 2]
        goodput = MlflowClient(tracking_uri()).get_metric_history(record.run_id, "server/goodput_rps")
        assert {m.step: m.value for m in goodput} == {c: m.goodput_rps for c, m in s.per_level.items()}


def test_a_server_that_cannot_be_reached_is_one_clear_error(own_root):
    env = root_env(own_root)
    args = ["serve", "--model", "ref-small", "--precision", "fp8", "--url", "http://127.0.0.1:9"]
    done = qeval(*args, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "warm-up request failed" in last and "ClientConnectorError" in last
    bad = qeval(*args[:-2], "--url", "localhost:8000", env=env)
    assert bad.returncode == 2 and "--url must be an http(s) base URL" in bad.stderr


def test_a_server_the_user_runs_is_driven_by_url(own_root, tmp_path):
    from memory_tracker import MemoryTracker

    from pipelines.core.procs import running
    from pipelines.core.weights import checkpoint_for
    from pipelines.stages.engines import transformers_command

    card = load_card("ref-small")
    checkpoint, _ = checkpoint_for(card, "fp8")
    cmd = transformers_command(checkpoint, trust_remote_code=False)
    with running(cmd, tmp_path / "server.log", 300, "transformers serve") as url:
        record = serve(card, "fp8", MemoryTracker(card.name), url=url)
    assert record.result.engine == "external" and record.result.failed_requests == 0
    assert card.server.served_accuracy and "served accuracy" in record.result.not_run  # said, not dropped silently
    records = read_csv(record.path / "requests.csv")
    assert len(records) == 6 and all(r.ok for r in records)
    assert not (record.path / "server.log").exists()  # not ours to start, nor to log


def test_a_generative_task_runs_greedily_through_vllm_as_offline(tmp_path):
    """refkjv_continue through vLLM's completions API (lm-eval's local-completions backend, as the serve stage
    scores a build) and offline, on the same documents: the served generations stop at the line's end, are
    scored per document, and are mostly the offline ones, word for word (both greedy, in one dtype; a
    prompt off by one token would make every one differ)."""
    import eval.paired
    from eval import accuracy
    from pipelines.core.procs import running
    from pipelines.stages import engines
    from pipelines.stages.serve import vllm_settings
    from quant.execution import Device, compute_dtype

    card = load_card("ref-lm")
    ckpt = str(REPO / "refmodel/ref-lm")
    offline = accuracy.AccuracyConfig(
        checkpoint=ckpt, tasks=["refkjv_continue"], include_path=str(REPO / "eval/tasks/refkjv"), num_fewshot=0,
        limit=8, batch_size=8, seed=0, dtype=compute_dtype(Device("cpu")),
    )  # fmt: skip
    for side in ("offline", "served"):
        (tmp_path / side).mkdir()
    off_result = accuracy.evaluate_accuracy(offline, tmp_path / "offline")
    vllm = engines.find_vllm()
    assert vllm is not None, "make engine"
    cmd, env = engines.vllm_command(vllm.python, ckpt, vllm_settings(card, "bf16", ckpt, Device("cpu")), False)
    with running(cmd, tmp_path / "server.log", card.server.start_timeout_s, "vLLM", env) as url:
        served = offline.model_copy(
            update={"backend": "local-completions", "base_url": url, "served_model": ckpt, "max_length": 512}
        )
        result = accuracy.evaluate_accuracy(served, tmp_path / "served")
    assert result.backend == "local-completions" and result.n_samples == {"refkjv_continue": 8}

    def generated(side: str) -> dict[int, str]:
        rows = (tmp_path / side / "samples_refkjv_continue.jsonl").read_text().splitlines()
        return {r["doc_id"]: r["filtered_resps"][0] for r in map(json.loads, rows)}

    served_text, offline_text = generated("served"), generated("offline")
    assert served_text.keys() == offline_text.keys() and len(served_text) == 8
    assert all(t.strip() and "\n" not in t for t in served_text.values())
    same = sum(served_text[d] == offline_text[d] for d in served_text)
    assert same >= 6, (same, served_text, offline_text)
    # the paired reading the gate and the serve stage use: served against offline, in generated tokens
    both = [eval.paired.Scored(tmp_path / side, r) for side, r in (("offline", off_result), ("served", result))]
    g = eval.paired.generation("refkjv_continue", *both, band=0.1, bootstrap=card.gate.bootstrap)
    assert g.departures.identical == same and g.length.n == 8
