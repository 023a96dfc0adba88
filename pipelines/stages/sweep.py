"""One server sweep, as the serve stage (real checkpoints) and the shape stage (random weights at a real
model's shape) both run it: the load generator's own ceiling, the concurrency levels under the card's SLO
with their progress lines, the realised-length check, the rule for a server that stops answering, and the
summary of the levels and of the kernels vLLM chose.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path

import eval.load.edge as edge
import eval.load.loadgen as loadgen
import eval.load.server_view as server_view
import eval.load.serving as serving
import eval.load.stream_stub as stream_stub
from pipelines.core.store.results import GeneratorCeiling, LinearKernel
from pipelines.core.system.errors import QevalError
from pipelines.core.system.net import answers
from pipelines.core.system.procs import running
from pipelines.stages import engines
from quant.execution import Device, Execution

log = logging.getLogger(__name__)
CEILING_OUTPUT = 256  # chunks per request against the stub
SERVER_NICE = 10
"""How far below normal priority a server qeval sweeps runs (procs.running): where the server and the load
generator share a machine's cores, the generator otherwise waits behind the server's busy threads (seen for
seconds on two cores), and tokens it has not read look late and bunched (docs/measurement.md, "How the
server is measured"). The other way round, the little the generator takes shows in the server's
latencies, which is where a measurement can bear it."""


_CEILINGS: dict[tuple[int, int], GeneratorCeiling] = {}
"""The generator's ceiling per (concurrency, requests per user), measured once per process: it is this
machine's client, not the build's, and `qeval run` would otherwise pay a stub server's start per stage."""


def generator_ceiling(work: Path, concurrency: int, requests_per_user: int) -> GeneratorCeiling:
    """Streamed chunks per second the generator takes in from an endpoint that answers instantly (measured
    the first time this process asks, with the stub's log in `work`)."""
    key = (concurrency, requests_per_user)
    if key not in _CEILINGS:
        _CEILINGS[key] = _measure_ceiling(work, concurrency, requests_per_user)
    return _CEILINGS[key]


def _measure_ceiling(work: Path, concurrency: int, requests_per_user: int) -> GeneratorCeiling:
    cmd = [sys.executable, "-m", stream_stub.__name__, "--port", "{port}"]
    with running(cmd, work / "stub.log", 60, "the stub endpoint") as url:
        cfg = loadgen.LoadConfig(
            url=url,
            model="stub",
            api="completions",
            concurrency=[concurrency],
            requests_per_user=requests_per_user,
            warmup=1,
            input_len=1,
            output_len=CEILING_OUTPUT,
            timeout_s=60,
        )
        records = loadgen.sweep(cfg, ["x"])
    ok = [r for r in records if r.ok]
    span = max(r.end for r in records) - min(r.start for r in records)
    chunks = sum(len(r.token_times) for r in ok)
    return GeneratorCeiling(chunks_per_s=chunks / span, concurrency=concurrency, failed=len(records) - len(ok))


@dataclass
class Seen:
    """What a sweep learns beside its requests: the server's own view of each level (its /metrics before and
    after; eval/load/server_view.py), where it has one, and why each level has the requests it has."""

    views: dict[int, server_view.ServerView] = field(default_factory=dict)
    sizing: dict[int, str] = field(default_factory=dict)
    bound: str | None = None  # why the load was raised no further (eval/load/edge.py, AT_*), where no level missed


def run_levels(
    label: str,
    base_url: str,
    model: str,
    load: loadgen.LoadSettings,
    prompts: Sequence[loadgen.Prompt],
    slo: serving.Slo,
    where: str,
    seen: Seen | None = None,
    fixed: dict[int, int] | None = None,
    room: int | None = None,
    ceiling: GeneratorCeiling | None = None,
) -> list[serving.RequestRecord]:
    """Sweep the server at `base_url` over `load`'s levels, a progress line per level, then (where `load.edge`
    says) the levels that raise the load past the grid while none misses and those that bisect toward the
    objective's edge, each level with the requests its p95s' intervals need (eval/load/edge.py); the raise goes no
    further than the sequences the server has `room` for, nor than the generator's `ceiling` holds. `where`
    names what to read when it fails (its log, or the URL of a server the user runs). `seen`, where given, gets
    the server's own view of each level, why it has its requests and why the load went no higher. `fixed`
    (users -> requests) sweeps those levels instead, with those requests each, and adds none."""
    before: dict[int, server_view.Snapshot | None] = {}
    verdicts: dict[int, serving.Verdict] = {}
    levels_tps: dict[int, float] = {}
    if fixed:
        load = load.model_copy(update={"concurrency": sorted(fixed), "edge": None})
    search = load.edge
    began = time.monotonic()
    added = 0  # levels the edge search has added

    def in_time() -> bool:  # the grid runs whole; past max_s nothing more is added
        return search is not None and time.monotonic() - began < search.max_s

    def starting(c: int) -> None:
        if seen is not None:
            before[c] = server_view.read(base_url)

    def more(c: int, level: list[serving.RequestRecord]) -> bool:
        """Another round at level c while a p95's interval is too wide, within the card's bounds; the
        level's reason for its requests noted."""
        if fixed:
            return len(level) < fixed[c]
        if search is None:
            return False
        m = serving.level_metrics(level, slo)
        share = search.interval_share
        wide = edge.too_wide(m.ttft_ms_p95_interval, slo.ttft_ms, share) or edge.too_wide(
            m.tpot_ms_p95_interval, slo.tpot_ms, share
        )
        if m.slo_verdict == serving.Verdict.FAIL:
            why = edge.MISSED
        elif not wide:
            why = edge.SIZED.format(share=share)
        elif len(level) + c * load.requests_per_user > c * search.max_requests_per_user:
            why = edge.CAPPED.format(n=search.max_requests_per_user)
        elif not in_time():
            why = edge.TIMED.format(s=search.max_s)
        else:
            return True
        if seen is not None:
            seen.sizing[c] = why
        return False

    def level_done(c: int, level: list[serving.RequestRecord]) -> None:
        if seen is not None and before.get(c) is not None and (after := server_view.read(base_url)) is not None:
            seen.views[c] = server_view.between(before[c], after)
        m = serving.level_metrics(level, slo)
        verdicts[c] = m.slo_verdict or (serving.Verdict.PASS if m.meets_slo else serving.Verdict.FAIL)
        levels_tps[c] = m.output_tps or 0.0
        log.info(
            "%s concurrency %d: %d requests, %d failed, TTFT p50 %.0f ms, TPOT p50 %.1f ms, %.1f tok/s, %s",
            label,
            c,
            m.requests,
            m.failed,
            m.ttft_ms_p50 or float("nan"),
            m.tpot_ms_p50 or float("nan"),
            m.output_tps or 0.0,
            m.slo_verdict,
        )
        if m.bursts:
            log.warning(
                "%s concurrency %d: %d requests arrived in one burst, not streamed: their TPOT is not "
                "measured and the level is not counted as meeting the SLO (the load generator's longest stall "
                "meanwhile %.0f ms); rerun with --force",
                label,
                c,
                m.bursts,
                m.client_stall_ms,
            )
        if m.client_held:
            log.warning(
                "%s concurrency %d: the load generator itself was held up (up to %.0f ms) with %d requests in "
                "flight: their times are partly its own, and a miss that rests on them is too close to call",
                label,
                c,
                m.client_stall_ms,
                m.client_held,
            )
        if load.exact_length == "ignore_eos" and (
            bad := serving.length_mismatches(level, load.input_len, load.output_len)
        ):
            raise QevalError(
                f"{label}: {len(bad)} of {len(level)} requests at concurrency {c} did not have the "
                f"asked lengths ({bad[0]}): the level measures something else; see {where}"
            )

    def stop(why: str) -> None:
        if seen is not None and serving.Verdict.FAIL not in verdicts.values():
            seen.bound = why

    def then() -> int | None:
        nonlocal added
        if search is None:
            return stop(edge.AT_GRID)
        if added >= search.levels:
            return stop(edge.AT_LEVELS.format(n=search.levels))
        if not in_time():
            return stop(edge.AT_TIME.format(s=search.max_s))
        limit, why = _raise_limit(search, room, ceiling, levels_tps)
        c = edge.next_level(verdicts, search.tolerance, limit)
        if c is None:
            stop(why)
        else:
            added += 1
            log.info(
                "%s: concurrency %d next, toward the objective's edge (added level %d of %d)",
                label,
                c,
                added,
                search.levels,
            )
        return c

    try:
        cfg = loadgen.LoadConfig(url=base_url, model=model, **load.model_dump())
        return loadgen.sweep(cfg, prompts, level_done, starting, more, then)
    except RuntimeError as e:
        raise QevalError(f"{label} server: {e}; check {where}") from None


def _raise_limit(
    search: edge.EdgeSearch, room: int | None, ceiling: GeneratorCeiling | None, levels_tps: dict[int, float]
) -> tuple[int, str]:
    """The most users the load may be raised to past the grid, and the bound that sets it: the card's, the
    server's room, the concurrency the generator's ceiling was measured at; none past the highest level judged
    where the generator's ceiling is under 10x a level's tokens/s (its figures may be its own)."""
    top = max(levels_tps, default=0)
    if ceiling is not None and ceiling.chunks_per_s < 10 * max(levels_tps.values(), default=0.0):
        return top, edge.AT_GENERATOR.format(chunks=ceiling.chunks_per_s, tps=max(levels_tps.values()))
    bounds = [(search.max_users, edge.AT_USERS.format(n=search.max_users))]
    if room is not None:
        bounds.append((room, edge.AT_ROOM.format(n=room)))
    if ceiling is not None:
        bounds.append((ceiling.concurrency, edge.AT_CEILING.format(n=ceiling.concurrency)))
    return min(bounds)


def more_starts(
    label: str,
    starts: int,
    start_server: Callable[[Path], AbstractContextManager[str]],
    model: str,
    load: loadgen.LoadSettings,
    prompts: Sequence[loadgen.Prompt],
    slo: serving.Slo,
    out: Path,
    first: list[serving.RequestRecord],
) -> list[serving.RequestRecord]:
    """The first start's records and those of starts 2 to `starts` (the card's server.starts): each a server
    started afresh (`start_server(its log)`, a context giving its URL; the log `server-K.log` in `out`), swept
    over the levels the first start judged with as many requests each, its records numbered by start (`run`);
    so that a level's intervals cover what differs from one start to the next (eval/quality/stats.py, `two_stage`)."""
    levels = dict(Counter(r.concurrency for r in first))
    out_records = list(first)
    for k in range(1, starts):
        server_log = out / f"server-{k + 1}.log"
        where = f"its log {server_log}"
        log.info("%s: server start %d of %d, the first start's %d levels again", label, k + 1, starts, len(levels))
        with start_server(server_log) as url:
            records = [
                replace(r, run=k) for r in run_levels(label, url, model, load, prompts, slo, where, fixed=levels)
            ]
            check_alive(label, url, out_records + records, out, where)
        out_records += records
    return out_records


def check_alive(label: str, base_url: str, records: list[serving.RequestRecord], out: Path, where: str) -> None:
    """The rule: failed requests from a server that still answers are data (the level misses the SLO); a
    server that stopped answering during the sweep fails the stage, which is then not cached."""
    if answers(base_url):
        return
    serving.write_csv(records, out / "requests.csv")  # kept in the failed folder
    failed = sum(not r.ok for r in records)
    raise QevalError(
        f"{label}: the server stopped answering during the sweep ({failed} of {len(records)} "
        f"requests failed); see {where}; rerun when it is fixed"
    )


def levels_summary(
    records: list[serving.RequestRecord],
    slo: serving.Slo,
    ceiling: GeneratorCeiling,
    seen: Seen | None = None,
) -> dict:
    """The fields of a sweep's result that its records give: per level, users within the SLO, failures, and
    whether the generator's ceiling bounds the figures; each level with the server's own view where read and
    why it has its requests."""
    seen = seen or Seen()
    per_level = {
        c: m.model_copy(update={"server": seen.views.get(c), "sizing": seen.sizing.get(c)})
        for c, m in serving.sweep_metrics(records, slo).items()
    }
    peak = max((m.output_tps or 0.0 for m in per_level.values()), default=0.0)
    bound = ceiling.chunks_per_s < 10 * peak
    if bound:
        log.warning(
            "the load generator's ceiling (%.0f chunks/s) is under 10x the server's peak %.0f tokens/s: "
            "its figures may be the generator's",
            ceiling.chunks_per_s,
            peak,
        )
    missed = any(
        m.slo_verdict == serving.Verdict.FAIL or not (m.slo_verdict or m.meets_slo) for m in per_level.values()
    )
    return {
        "per_level": per_level,
        "max_users_at_slo": serving.max_users_at_slo(per_level),
        "users_at_slo_interval": serving.users_interval(per_level),
        "users_bound": None if missed or not per_level else seen.bound or edge.AT_GRID,
        "failed_requests": sum(m.failed for m in per_level.values()),
        "generator_bound": bound,
    }


def vllm_kernels(label: str, log_file: Path, precision: str, device: Device) -> tuple[list[LinearKernel], Execution]:
    """The linear kernels vLLM says in its log it chose, and how they ran the build here."""
    kernels = engines.kernels_from_log(log_file.read_text(errors="replace"), precision, device)
    how = engines.served_execution(precision, device, kernels)
    chosen = ", ".join(f"{k.kernel} for {k.method}" for k in kernels) or "none reported (unquantized)"
    log.info("%s: vLLM's linear kernels: %s (%s)", label, chosen, how)
    return kernels, how
