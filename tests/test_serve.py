"""The server benchmark for real, on loopback: `transformers serve` (the fallback engine) on the reference
model's builds, a server the user runs, and one that cannot be reached. vLLM serving every build, and
accuracy through its server against the offline one, are the session's pipeline run's (tests/test_pipeline.py)."""

from __future__ import annotations

from pathlib import Path

import lanes
import pytest
from helpers import qeval, root_env
from mlflow.tracking import MlflowClient

from conftest import copy_root
from eval.load.serving import read_csv
from pipelines.core.card.cards import load_card
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
    # gptq's server is started twice (server.starts): the second start sweeps the levels the first judged
    return {p: serve(_on(card, starts=2) if p == "gptq" else card, p, tracker) for p in ("bf16", "gptq")}


def test_a_short_sweep_over_a_real_server(served):
    for p, record in served.items():
        records = read_csv(record.path / "requests.csv")
        starts = 2 if p == "gptq" else 1
        # the grid's 2 + 4 requests, and any rounds of 2 per user its intervals asked for, then the levels past
        # the grid or toward its edge (server.edge), in the order swept; each start after the first the same
        # levels with as many requests, its records numbered by start
        asked = {c: m.requests // starts for c, m in record.result.per_level.items()}
        first = list(dict.fromkeys(r.concurrency for r in records if r.run == 0))
        assert first[:2] == [1, 2] and sorted(first) == list(asked)
        assert [(r.run, r.concurrency, r.index) for r in records] == [
            (k, c, i) for k in range(starts) for c in (first if k == 0 else sorted(first)) for i in range(asked[c])
        ]
        assert record.result.starts == starts and (record.path / "server-2.log").exists() == (starts == 2)
        assert asked[1] in range(2, 9, 2) and asked[2] in range(4, 17, 4)
        missed = any(m.slo_verdict == "FAIL" for m in record.result.per_level.values())
        assert (record.result.users_bound is None) == missed, record.result.users_bound
        assert all(r.ok for r in records), [r.error for r in records if not r.ok]
        assert {r.output_tokens for r in records} == {8}  # exactly the card's output length
        assert all(len(r.token_times) >= 2 and r.start < r.first_token <= r.end for r in records)
        assert {r.prompt_tokens for r in records} <= {32, 33}  # 32-token prompts (+ BOS where added)
        assert "Application startup complete" in (record.path / "server.log").read_text()
        s = record.result
        assert s.engine == "transformers" and s.failed_requests == 0 and s.load.exact_length == "generation_config"
        peak = max(m.output_tps for m in s.per_level.values())
        assert s.generator_ceiling.chunks_per_s > 10 * peak and not s.generator_bound  # not the bottleneck
        assert 0 <= s.max_users_at_slo <= max(asked)  # past the grid where it missed nothing
        assert all(m.ttft_ms_p50 <= m.ttft_ms_p90 <= m.ttft_ms_p99 for m in s.per_level.values())

        data = MlflowClient(tracking_uri()).get_run(record.run_id).data
        assert data.params["server.engine"] == "transformers" and data.params["server.starts"] == str(starts)
        assert data.tags["qeval.stage.serve"] == "done"
        assert data.params.get("server.users_bound") == s.users_bound  # where no level missed, why none was tried
        steps = MlflowClient(tracking_uri()).get_metric_history(record.run_id, "server/ttft_ms_p90")
        assert sorted(m.step for m in steps) == list(asked)  # one step per level swept
        goodput = MlflowClient(tracking_uri()).get_metric_history(record.run_id, "server/goodput_rps")
        assert {m.step: m.value for m in goodput} == {c: m.goodput_rps for c, m in s.per_level.items()}
        # each level's throughput with its interval over the requests, which holds the level's figure
        lows = MlflowClient(tracking_uri()).get_metric_history(record.run_id, "server/output_tps_lo")
        assert {m.step: m.value for m in lows} == {c: m.output_tps_interval[0] for c, m in s.per_level.items()}
        assert all(
            lo - 1e-6 <= m.output_tps <= hi + 1e-6 for m in s.per_level.values() for lo, hi in [m.output_tps_interval]
        )


def _unreachable(folder: Path, env: dict[str, str], session: Path) -> tuple:
    """`qeval serve --url` of fp8 in a copy of the session's folder, to a port nobody listens on, then to an
    address that is no URL. Beside the tests (tests/lanes.py)."""
    env = root_env(copy_root(session, folder / "own"), env)
    args = ["serve", "--model", "ref-small", "--precision", "fp8"]
    return qeval(*args, "--url", "http://127.0.0.1:9", env=env), qeval(*args, "--url", "localhost:8000", env=env)


unreachable = lanes.side_job("unreachable", _unreachable, after="builds")


def test_a_server_that_cannot_be_reached_is_one_clear_error(unreachable):
    done, bad = unreachable
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "warm-up request failed" in last and "ClientConnectorError" in last
    assert bad.returncode == 2 and "--url must be an http(s) base URL" in bad.stderr


def test_a_server_the_user_runs_is_driven_by_url(own_root, tmp_path):
    from memory_tracker import MemoryTracker

    from pipelines.core.framework.weights import checkpoint_for
    from pipelines.core.system.procs import running
    from pipelines.stages.engines import transformers_command

    card = load_card("ref-small")
    checkpoint, _ = checkpoint_for(card, "fp8")
    cmd = transformers_command(checkpoint, trust_remote_code=False)
    with running(cmd, tmp_path / "server.log", 300, "transformers serve") as url:
        record = serve(card, "fp8", MemoryTracker(card.name), url=url)
    assert record.result.engine == "external" and record.result.failed_requests == 0
    assert card.server.served_accuracy and "served accuracy" in record.result.not_run  # said, not dropped silently
    records = read_csv(record.path / "requests.csv")
    levels = record.result.per_level  # the grid's 6 requests, and the rounds its intervals asked for (server.edge)
    assert len(records) == sum(m.requests for m in levels.values()) >= 6 and all(r.ok for r in records)
    assert all(m.sizing for m in levels.values())
    assert not (record.path / "server.log").exists()  # not ours to start, nor to log
