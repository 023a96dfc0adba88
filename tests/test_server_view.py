"""The server's own view of a load level (eval/load/server_view.py), on vLLM's /metrics as a vLLM 0.32 server of
ref-lm exported it, read before and after 8 concurrent requests (tests/data/vllm_metrics_*.txt: its `vllm:`
families, as recorded)."""

from __future__ import annotations

import pytest
from helpers import REPO

from eval.load.server_view import ServerView, between, cause, parse

DATA = REPO / "tests/data"


@pytest.fixture(scope="module")
def recorded():
    return parse((DATA / "vllm_metrics_before.txt").read_text()), parse((DATA / "vllm_metrics_after.txt").read_text())


def test_a_recorded_exposition_reads_as_counters_histograms_and_gauges(recorded):
    before, after = recorded
    assert set(after.gauges) == {"running", "waiting", "kv_cache_usage"}
    assert set(after.counters) == {"preemptions", "finished"}
    assert set(after.histograms) == {"ttft", "tpot", "queue", "prefill"}
    assert after.counters["finished"] - before.counters["finished"] == 8  # the requests sent between the two
    assert after.histograms["ttft"][1] - before.histograms["ttft"][1] == 8


def test_the_level_between_two_readings(recorded):
    view = between(*recorded)
    assert view.finished == 8 and view.preemptions == 0
    assert 0 < view.queue_ms_mean < view.ttft_ms_mean and view.prefill_ms_mean > 0 and view.tpot_ms_mean > 0
    assert view.running_after == 0 and view.waiting_after == 0 and 0 <= view.kv_cache_usage_after <= 1
    # the means are the histograms' sums over their counts, by hand
    (s0, n0), (s1, n1) = recorded[0].histograms["ttft"], recorded[1].histograms["ttft"]
    assert view.ttft_ms_mean == pytest.approx(1000 * (s1 - s0) / (n1 - n0))


def test_what_broke_a_level_by_the_servers_view():
    assert cause(ServerView(preemptions=3, ttft_ms_mean=900, queue_ms_mean=800)).startswith("the KV cache filled")
    assert cause(ServerView(preemptions=0, ttft_ms_mean=400, queue_ms_mean=300)).startswith("queueing: 300 ms")
    assert cause(ServerView(preemptions=0, ttft_ms_mean=400, queue_ms_mean=20, prefill_ms_mean=350)) == (
        "the work itself: mean first token 400 ms, 350 ms of it prefill, little queueing"
    )
    assert cause(ServerView()) == "the server reports no metrics"
    # int8 at 11 users in a `make run` (docs/results.md): the engine's first tokens in 58 ms on average, the
    # client's p95 639 ms with 4 requests delivered whole: late after the engine, not in it
    engine = ServerView(preemptions=0, ttft_ms_mean=58, queue_ms_mean=0.02, prefill_ms_mean=51)
    assert cause(engine, 4, 639).startswith("delivery after the engine: 4 requests' tokens arrived in one burst")
    assert cause(engine, 4, 639, 12).endswith(
        "the server's front end: the load generator was never held up more than 12 ms"
    )
    assert "held by the load generator itself, held up 400 ms: a fault of the measurement" in cause(engine, 4, 639, 400)
    assert cause(engine, 0, 639).startswith("the work itself")  # late without bursts: not a delivery stall
    assert cause(engine, 4, 100).startswith("the work itself")  # bursts that did not hold the first token back
    assert parse("# nothing here\n").counters == {}  # a server that exports none of them


@pytest.fixture(scope="module")
def metrics_server():
    """A loopback server whose /metrics answers as the path's first part says: whole, a login page, a drip
    that never ends, an answer without end, or figures that are not finite."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            kind = self.path.strip("/").split("/")[0]
            self.send_response(200)
            self.end_headers()
            if kind == "whole":
                self.wfile.write((DATA / "vllm_metrics_after.txt").read_bytes())
            elif kind == "login":
                self.wfile.write(b"<!doctype html><html><body><form>Sign in</form></body></html>\n")
            elif kind == "nan":
                self.wfile.write(b"vllm:num_preemptions_total NaN\nvllm:request_success_total 3\n")
            else:
                try:
                    for _ in range(2000):  # "drip": a byte every 10 ms; "flood": a megabyte at a time
                        self.wfile.write(b"#" if kind == "drip" else b"# " * (1 << 19))
                        self.wfile.flush()
                        time.sleep(0.01 if kind == "drip" else 0)
                except OSError:  # the reader gave up, as it should
                    pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads, server.block_on_close = True, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["login", "nan", "drip", "flood"])
def test_a_metrics_reading_that_is_not_one_costs_that_reading_within_its_bound(metrics_server, kind):
    """Issue 67: a login page failed the whole serve stage ("invalid metric name"); an answer without end was read
    without a bound."""
    import time

    from eval.load.server_view import read

    assert read(f"{metrics_server}/whole").counters  # the recorded exposition, as the server sends it
    t0 = time.monotonic()
    assert read(f"{metrics_server}/{kind}", timeout_s=0.5) is None
    assert time.monotonic() - t0 < 2
