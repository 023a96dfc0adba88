"""Server-benchmark metrics from raw per-request timestamps (pure functions).

Definitions follow `vllm bench serve`: TTFT is request start to the first streamed token; ITL the
gaps between streamed tokens; TPOT (e2e - TTFT) / (output tokens - 1) per request; throughput counts
what finished inside the level's wall time, from the first request's start to the last one's end.
Goodput counts the requests that met every latency objective on their own; a concurrency level meets
the objective when the 95th percentiles of TTFT and TPOT are measured and within it and no request failed
(a stream cut short is a failed request: eval/load/loadgen.py). Each level is also judged on those percentiles'
bootstrap intervals over its requests (eval/quality/stats.py): it meets the objective (PASS), misses it (FAIL), or is
too close to call (INCONCLUSIVE), and users within the objective become a range over the judged levels (the
grid, and the levels eval/load/edge.py adds toward the edge). Where the
server was held to exact lengths, every request's realised prompt and output token counts are checked against
what was asked (length_mismatches): a benchmark that silently generated one token measures nothing.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from pydantic import BaseModel, Field

from eval.devices.speed import percentile, tpot_s
from eval.load import server_view
from eval.load.server_view import ServerView
from eval.quality.stats import Verdict, at_most, percentile_interval, ratio_interval

QUANTILES = (50, 90, 95, 99)
CLIENT_STALL_SHARE = 0.1
"""A request the load generator itself held up (RequestRecord.client_stall_ms) for more than this share of the TTFT
objective was mismeasured: a level that misses the objective, and would not with every request's stall taken off
its times, is too close to call."""
BURST_S = 0.001  # a request whose every token arrived within this span was not streamed as generated


@dataclass(frozen=True)
class RequestRecord:
    """One request of a sweep; times in seconds on one monotonic clock."""

    concurrency: int
    index: int
    start: float
    end: float
    ok: bool
    first_token: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    token_times: tuple[float, ...] = field(default=())  # arrival of each chunk that carried tokens
    error: str = ""
    # the longest the load generator's own event loop was held up while this request was in flight (a ticker's
    # lateness, eval/load/loadgen.py): where its tokens came late, whether the client or the server held them
    client_stall_ms: float = 0.0
    run: int = 0  # which start of the server measured it (the card's server.starts), from 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None:
            return None
        t = tpot_s(self.ttft, self.e2e, self.output_tokens)
        return None if math.isnan(t) else t

    @property
    def burst(self) -> bool:
        """Its tokens arrived together (all within BURST_S, or in one chunk), not one by one as they were
        generated: its TTFT then includes the decode and its TPOT measures nothing (seen once on a 2-core CPU,
        where vLLM's front end waited for a core; a server that buffers its stream does it every time)."""
        t = self.token_times
        return self.ok and self.output_tokens > 2 and (len(t) < 2 or t[-1] - t[0] < BURST_S)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float


class LevelMetrics(BaseModel):
    """One concurrency level of a sweep; latencies in ms, None where no request succeeded."""

    requests: int
    failed: int
    meets_slo: bool = Field(
        description="p95 TTFT and p95 TPOT measured and within the SLO, no request failed and every one was streamed"
    )
    bursts: int = Field(0, description="requests whose tokens arrived in one burst (RequestRecord.burst)")
    client_stall_ms: float = Field(0.0, description="the load generator's longest stall with a request in flight")
    client_held: int = Field(
        0, description="requests the generator itself held up for more than CLIENT_STALL_SHARE of the TTFT objective"
    )
    goodput_rps: float = Field(0.0, description="requests per second that met both objectives on their own")
    slo_attainment: float = Field(0.0, description="share of the level's requests that met both objectives")
    duration_s: float | None = None
    request_tps: float | None = Field(None, description="finished requests per second")
    output_tps: float | None = Field(None, description="output tokens per second, all users")
    output_tps_interval: tuple[float, float] | None = Field(
        None, description="95 % bootstrap interval, requests (throughput_interval)"
    )
    output_tps_per_user: float | None = Field(None, description="1 / median TPOT")
    ttft_ms_p50: float | None = None
    ttft_ms_p90: float | None = None
    ttft_ms_p95: float | None = None
    ttft_ms_p99: float | None = None
    tpot_ms_p50: float | None = None
    tpot_ms_p90: float | None = None
    tpot_ms_p95: float | None = None
    tpot_ms_p99: float | None = None
    itl_ms_p50: float | None = None
    itl_ms_p90: float | None = None
    itl_ms_p95: float | None = None
    itl_ms_p99: float | None = None
    e2e_ms_p50: float | None = None
    e2e_ms_p90: float | None = None
    e2e_ms_p95: float | None = None
    e2e_ms_p99: float | None = None
    ttft_ms_p95_interval: tuple[float, float] | None = Field(None, description="95 % bootstrap interval, requests")
    tpot_ms_p95_interval: tuple[float, float] | None = Field(None, description="95 % bootstrap interval, requests")
    slo_verdict: Verdict | None = Field(
        None, description="the objective judged on those intervals: met (PASS), missed (FAIL) or too close to call"
    )
    server: ServerView | None = Field(None, description="the server's own view of the level (its /metrics)")
    sizing: str | None = Field(None, description="why the level has the requests it has (eval/load/edge.py)")

    @property
    def output_tps_lo(self) -> float | None:
        return self.output_tps_interval and self.output_tps_interval[0]

    @property
    def output_tps_hi(self) -> float | None:
        return self.output_tps_interval and self.output_tps_interval[1]


def what_broke(m: LevelMetrics) -> str:
    """The server's view of why a level missed (eval/load/server_view.py, `cause`), with what the client saw of it."""
    if m.server is None:
        return ""
    return server_view.cause(m.server, m.bursts, m.ttft_ms_p95, m.client_stall_ms)


def _ms(values: Iterable[float | None]) -> list[float]:
    return [1000 * v for v in values if v is not None]


def level_metrics(records: Sequence[RequestRecord], slo: Slo) -> LevelMetrics:
    """Metrics of one concurrency level (all its measured requests)."""
    ok = [r for r in records if r.ok]
    failed = len(records) - len(ok)
    if not ok:
        return LevelMetrics(requests=len(records), failed=failed, meets_slo=False)
    span = wall_time(records)
    (ttft_ms, ttft_runs), (tpot_ms, tpot_runs) = _by_run(ok, "ttft"), _by_run(ok, "tpot")
    series = {
        "ttft_ms": ttft_ms,
        "tpot_ms": tpot_ms,
        "itl_ms": _ms(g for r in ok for g in r.itls),
        "e2e_ms": _ms(r.e2e for r in ok),
    }
    quantiles = {f"{name}_p{q}": percentile(v, q) for name, v in series.items() if v for q in QUANTILES}
    good = [
        r
        for r in ok
        if r.ttft is not None and 1000 * r.ttft <= slo.ttft_ms and (r.tpot is None or 1000 * r.tpot <= slo.tpot_ms)
    ]
    tokens = sum(r.output_tokens for r in ok)
    per_second = (lambda n: n / span) if span > 0 else (lambda n: 0.0)
    bursts = sum(r.burst for r in ok)
    meets = (
        failed == 0
        and bursts == 0
        and quantiles.get("ttft_ms_p95", math.inf) <= slo.ttft_ms
        and quantiles.get("tpot_ms_p95", math.inf) <= slo.tpot_ms  # measured figures only: TPOT needs 2 tokens
    )
    ttft = percentile_interval(ttft_ms, 95, groups=ttft_runs)
    tpot = percentile_interval(tpot_ms, 95, groups=tpot_runs)  # NaNs where no request had two tokens
    verdict = level_verdict(failed, ttft, tpot, slo, bursts)
    held = [r for r in ok if r.client_stall_ms > CLIENT_STALL_SHARE * slo.ttft_ms]
    if verdict == Verdict.FAIL and held and not failed and _judged([_unheld(r) for r in ok], slo) != Verdict.FAIL:
        verdict = Verdict.INCONCLUSIVE  # missed only with the time the generator itself held its requests up
    return LevelMetrics(
        requests=len(records),
        failed=failed,
        meets_slo=meets,
        ttft_ms_p95_interval=ttft[1:] if series["ttft_ms"] else None,
        tpot_ms_p95_interval=tpot[1:] if series["tpot_ms"] else None,
        slo_verdict=verdict,
        bursts=bursts,
        client_held=len(held),
        client_stall_ms=max(r.client_stall_ms for r in records),
        goodput_rps=per_second(len(good)),
        slo_attainment=len(good) / len(records),
        duration_s=span,
        request_tps=per_second(len(ok)),
        output_tps=per_second(tokens),
        output_tps_interval=throughput_interval(ok, per_second(tokens)),
        output_tps_per_user=1000 / quantiles["tpot_ms_p50"] if quantiles.get("tpot_ms_p50") else 0.0,
        **quantiles,
    )


def throughput_interval(ok: Sequence[RequestRecord], output_tps: float) -> tuple[float, float] | None:
    """A level's output tokens/s with a bootstrap interval over its requests. The level's figure is its tokens
    over its wall time; with its users each sending request after request, that is the users times their
    tokens over their requests' time, so the requests are resampled (eval/quality/stats.py, `ratio_interval`) and the
    figure scaled by each resample's ratio to the whole's. None without a figure."""
    point, lo, hi = ratio_interval([r.output_tokens for r in ok], [r.e2e for r in ok], groups=[r.run for r in ok])
    if not output_tps or not point > 0 or math.isnan(lo):
        return None
    return output_tps * lo / point, output_tps * hi / point


def wall_time(records: Sequence[RequestRecord]) -> float:
    """A level's wall time: from its first request's start to its last one's end, summed over the server's
    starts (each start's requests ran apart from the others')."""
    runs = {r.run for r in records}
    return sum(max(r.end for r in records if r.run == k) - min(r.start for r in records if r.run == k) for k in runs)


def _by_run(records: Sequence[RequestRecord], what: str) -> tuple[list[float], list[int]]:
    """Each request's `what` (ttft or tpot) in ms where it has one, and the server start that measured it."""
    timed = [(1000 * v, r.run) for r in records if (v := getattr(r, what)) is not None]
    return [v for v, _ in timed], [k for _, k in timed]


def _unheld(r: RequestRecord) -> RequestRecord:
    """The request at its fastest had the generator not been held up: its stall taken off its first token and,
    again, off its decode (each at most what it has), the reading most favourable to the server."""
    stall = r.client_stall_ms / 1000
    if not stall or r.ttft is None:
        return r
    first = min(stall, r.ttft)
    return replace(r, start=r.start + first, end=r.end - min(stall, r.e2e - r.ttft))


def _judged(records: list[RequestRecord], slo: Slo) -> Verdict:
    """level_verdict on these requests."""
    (ttft_ms, ttft_runs), (tpot_ms, tpot_runs) = _by_run(records, "ttft"), _by_run(records, "tpot")
    ttft = percentile_interval(ttft_ms, 95, groups=ttft_runs)
    tpot = percentile_interval(tpot_ms, 95, groups=tpot_runs)
    return level_verdict(0, ttft, tpot, slo, sum(r.burst for r in records))


def level_verdict(
    failed: int, ttft: tuple[float, float, float], tpot: tuple[float, float, float], slo: Slo, bursts: int = 0
) -> Verdict:
    """A level's objective on its p95s' intervals: any failed request misses it; else FAIL where either interval
    is wholly beyond it, PASS where both are within it and every request was streamed, INCONCLUSIVE otherwise
    (an unmeasured TPOT among them). A request that arrived in one burst counts in TTFT, which includes its
    whole decode, but its TPOT measures nothing: the level cannot be called met, nor missed on that alone (as a
    miss, a few bursts moved a build's edge far below its neighbours': docs/results.md)."""
    if failed:
        return Verdict.FAIL
    verdicts = [at_most(ttft, slo.ttft_ms), at_most(tpot, slo.tpot_ms)]
    if Verdict.FAIL in verdicts:
        return Verdict.FAIL
    met = all(v == Verdict.PASS for v in verdicts) and not bursts
    return Verdict.PASS if met else Verdict.INCONCLUSIVE


def users_interval(per_level: dict[int, LevelMetrics]) -> tuple[int, int] | None:
    """Users within the objective as a range over the judged levels: from the largest level with every level
    up to it met (PASS), to one under the first level missed (FAIL), the untested levels between unknown; to
    the largest level where none missed (the edge lies beyond what was judged). None where the levels were not
    judged so."""
    if not per_level or any(m.slo_verdict is None for m in per_level.values()):
        return None
    levels = sorted(per_level)
    lo = 0
    for c in levels:
        if per_level[c].slo_verdict != Verdict.PASS:
            break
        lo = c
    missed = next((c for c in levels if per_level[c].slo_verdict == Verdict.FAIL), None)
    return lo, max(lo, missed - 1) if missed is not None else levels[-1]


def length_mismatches(records: Sequence[RequestRecord], input_len: int, output_len: int) -> list[str]:
    """Each finished request whose realised prompt or output token count is not what was asked, as one
    line; a server that does not report its prompt's length counts as a mismatch (it cannot be checked)."""
    bad = []
    for r in records:
        if r.ok and (r.prompt_tokens != input_len or r.output_tokens != output_len):
            bad.append(
                f"request {r.index} at concurrency {r.concurrency}: {r.prompt_tokens} prompt tokens and "
                f"{r.output_tokens} output tokens, asked {input_len} and {output_len}"
            )
    return bad


def sweep_metrics(records: Sequence[RequestRecord], slo: Slo) -> dict[int, LevelMetrics]:
    """level_metrics per concurrency level, in increasing concurrency."""
    levels = sorted({r.concurrency for r in records})
    return {c: level_metrics([r for r in records if r.concurrency == c], slo) for c in levels}


def max_users_at_slo(per_level: dict[int, LevelMetrics]) -> int:
    """The largest concurrency that met the objective, with every lower level meeting it too (0: none)."""
    best = 0
    for c in sorted(per_level):
        if not per_level[c].meets_slo:
            break
        best = c
    return best


_COLUMNS = [f.name for f in fields(RequestRecord)]


def write_csv(records: Iterable[RequestRecord], path: Path) -> None:
    """The raw per-request timestamps, one row per request (token times joined by spaces)."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_COLUMNS)
        w.writeheader()
        for r in records:
            row = asdict(r)
            row["token_times"] = " ".join(f"{t:.6f}" for t in r.token_times)
            w.writerow(row)


def read_csv(path: Path) -> list[RequestRecord]:
    out = []
    with path.open() as f:
        for row in csv.DictReader(f):
            out.append(
                RequestRecord(
                    concurrency=int(row["concurrency"]),
                    index=int(row["index"]),
                    start=float(row["start"]),
                    end=float(row["end"]),
                    ok=row["ok"] == "True",
                    first_token=float(row["first_token"]) if row["first_token"] else None,
                    output_tokens=int(row["output_tokens"]),
                    prompt_tokens=int(row["prompt_tokens"]) if row["prompt_tokens"] else None,
                    token_times=tuple(float(t) for t in row["token_times"].split()),
                    error=row["error"],
                    client_stall_ms=float(row.get("client_stall_ms") or 0.0),  # absent from earlier sweeps
                    run=int(row.get("run") or 0),
                )
            )
    return out
