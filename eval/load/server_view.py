"""The server's own view of a load level: vLLM's Prometheus metrics (`/metrics`), read before and after the level.

Counters and histograms change by what the level did: requests finished, preemptions, and the server's own
mean time to first token, per output token, in the queue and in prefill (a histogram's sum over its count).
Gauges (requests running and waiting, KV-cache use) are what they are when read: after a closed-loop level
they are its tail, so the level's peak is not among them. Which of these broke the objective at a level is
`cause`'s reading: queueing where the requests waited most of their first token's time, a full KV cache where
the server preempted requests, delivery where the engine made the first tokens in time and the client got them
late and in one burst, else the work itself (prefill and decode time). Names as vLLM 0.32 exports them
(vllm/v1/metrics/loggers.py); a server without them (transformers serve, one the user runs) gives none.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pydantic import BaseModel, Field

GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
}
COUNTERS = {"preemptions": "vllm:num_preemptions", "finished": "vllm:request_success"}
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


@dataclass(frozen=True)
class Snapshot:
    """One reading of /metrics: gauges, counters, and each histogram's (sum, count), summed over label sets."""

    gauges: dict[str, float]
    counters: dict[str, float]
    histograms: dict[str, tuple[float, float]]


def parse(text: str) -> Snapshot:
    """A /metrics exposition (Prometheus text format) as a Snapshot of the metrics above; a metric absent is
    left out."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    gauges = {k: values[n] for k, n in GAUGES.items() if n in values}
    counters = {k: values[f"{n}_total"] for k, n in COUNTERS.items() if f"{n}_total" in values}
    histograms = {
        k: (values[f"{n}_sum"], values[f"{n}_count"])
        for k, n in HISTOGRAMS.items()
        if f"{n}_sum" in values and f"{n}_count" in values
    }
    return Snapshot(gauges, counters, histograms)


class ServerView(BaseModel):
    """What the server says of one level: its counters' change over it, its mean latencies, its gauges after."""

    finished: float | None = Field(None, description="requests the server finished during the level")
    preemptions: float | None = Field(None, description="requests preempted during the level (the KV cache full)")
    ttft_ms_mean: float | None = Field(None, description="the server's own mean time to first token")
    tpot_ms_mean: float | None = Field(None, description="the server's own mean time per output token")
    queue_ms_mean: float | None = Field(None, description="mean time a request waited before it was scheduled")
    prefill_ms_mean: float | None = Field(None, description="mean time of a request's prefill")
    running_after: float | None = None
    waiting_after: float | None = None
    kv_cache_usage_after: float | None = Field(None, description="share of the KV cache in use when read, 0-1")


def between(before: Snapshot, after: Snapshot) -> ServerView:
    """The level between two readings."""

    def mean_ms(name: str) -> float | None:
        if name not in before.histograms or name not in after.histograms:
            return None
        total = after.histograms[name][0] - before.histograms[name][0]
        count = after.histograms[name][1] - before.histograms[name][1]
        return 1000 * total / count if count > 0 else None

    def change(name: str) -> float | None:
        a, b = after.counters.get(name), before.counters.get(name)
        return None if a is None or b is None else a - b

    return ServerView(
        finished=change("finished"),
        preemptions=change("preemptions"),
        ttft_ms_mean=mean_ms("ttft"),
        tpot_ms_mean=mean_ms("tpot"),
        queue_ms_mean=mean_ms("queue"),
        prefill_ms_mean=mean_ms("prefill"),
        running_after=after.gauges.get("running"),
        waiting_after=after.gauges.get("waiting"),
        kv_cache_usage_after=after.gauges.get("kv_cache_usage"),
    )


DELIVERY_FACTOR = 2.0
"""How many times the engine's own mean first token the client's TTFT p95 must be, with requests delivered in
one burst, for a level to be called broken after the engine: the engine had the tokens, the user did not."""


def cause(
    view: ServerView, bursts: int = 0, client_ttft_ms_p95: float | None = None, client_stall_ms: float = 0.0
) -> str:
    """What the server's view says broke a level's objective, in a few words; with the level's bursts, its TTFT
    p95 as the client saw it and the client's own longest stall, a level whose first tokens were late after the
    engine made them says so, and whether the load generator (held up for at least half that lateness) or the
    server's front end held them."""
    engine = view.ttft_ms_mean
    if bursts and engine and client_ttft_ms_p95 and client_ttft_ms_p95 >= DELIVERY_FACTOR * engine:
        late = client_ttft_ms_p95 - engine
        who = (
            f"the load generator itself, held up {client_stall_ms:.0f} ms: a fault of the measurement"
            if client_stall_ms >= late / 2
            else f"the server's front end: the load generator was never held up more than {client_stall_ms:.0f} ms"
        )
        return (
            f"delivery after the engine: {bursts} requests' tokens arrived in one burst, TTFT p95 "
            f"{client_ttft_ms_p95:.0f} ms at the client against the engine's mean first token {engine:.0f} ms; "
            f"held by {who}"
        )
    if view.preemptions:
        return f"the KV cache filled: {view.preemptions:.0f} requests preempted"
    if view.queue_ms_mean is not None and view.ttft_ms_mean and view.queue_ms_mean >= view.ttft_ms_mean / 2:
        return f"queueing: {view.queue_ms_mean:.0f} ms of its {view.ttft_ms_mean:.0f} ms mean first token in the queue"
    if view.ttft_ms_mean is not None:
        prefill = f", {view.prefill_ms_mean:.0f} ms of it prefill" if view.prefill_ms_mean is not None else ""
        return f"the work itself: mean first token {view.ttft_ms_mean:.0f} ms{prefill}, little queueing"
    return "the server reports no metrics"


def read(base_url: str, timeout_s: float = 5.0) -> Snapshot | None:
    """The server's /metrics now; None where it has none (not vLLM), does not answer whole within about
    `timeout_s`, answers more than MAX_BYTES, or answers something that is not an exposition of finite figures
    (a login page): a bad reading costs that reading, not the level."""
    body = _fetch(f"{base_url}/metrics", timeout_s)
    if body is None:
        return None
    try:
        snapshot = parse(body.decode())
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    figures = [
        *snapshot.gauges.values(),
        *snapshot.counters.values(),
        *(x for h in snapshot.histograms.values() for x in h),
    ]
    if not all(math.isfinite(x) and x >= 0 for x in figures):
        return None
    return snapshot if snapshot.counters or snapshot.histograms else None


MAX_BYTES = 4 << 20
"""A /metrics answer longer than this is not read (vLLM's is tens of kilobytes)."""


def _fetch(url: str, timeout_s: float) -> bytes | None:
    """The body of a 200 answer at `url`, read within `timeout_s` and MAX_BYTES in all, else None."""
    import httpx

    deadline = time.monotonic() + timeout_s
    body = bytearray()
    try:
        with httpx.stream("GET", url, timeout=timeout_s) as reply:
            if reply.status_code != 200:
                return None
            for chunk in reply.iter_bytes():
                body += chunk
                if len(body) > MAX_BYTES or time.monotonic() > deadline:
                    return None
    except httpx.HTTPError:
        return None
    return bytes(body)
