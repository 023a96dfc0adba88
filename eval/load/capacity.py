"""Capacity and cost: how many devices a build needs for a card's traffic within its objective, and what that
costs (pure functions: numbers in, numbers out).

An instance is one server of a build: `devices` GPUs (its tensor-parallel degree) or one CPU machine. What
one instance serves within the objective is either measured, from a sweep's levels on that device
(`measured`), or projected from the model's bytes and FLOPs at a stated share of the device's peak
(`project`). The traffic is peak concurrent users, or a request rate that Little's law turns into users:
users = requests/s x end-to-end latency at that load. Then

    instances = ceil(users needed / users per instance),  devices = instances x devices per instance,
    $ per hour = devices x $ per device-hour,
    $ per million output tokens = $ per instance-hour / (output tokens/s x 3600) x 1e6,
    $ per request = $ per instance-hour / (requests/s x 3600),

the last two at the instance's highest-throughput load within the objective. A build that fits no device,
or holds no user within the objective, says so instead of dividing by zero.

Where no level missed the objective, the sweep stopped at a bound before finding the edge (eval/load/edge.py):
its users are then at least the figure, and the devices and costs that rest on them at most theirs.

A measured instance's users within the objective are a range (eval/load/serving.py, `users_interval`: from the
users every judged level up to met, to one under the first level missed), so its cost is a range too
(`bounds`): the conservative end holds the range's low end at the best throughput of the levels met, the
optimistic end its high end at the best of the levels not missed. Choices on cost rest on the conservative end.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from eval.devices.gpus import Gpu
from eval.devices.sizing import Assumptions, Shape, workspace_bytes
from eval.devices.speed import decode_step_bytes, mid_generation_context
from eval.load.serving import LevelMetrics, max_users_at_slo, users_interval
from eval.quality.stats import Verdict

TP_DEGREES = (1, 2, 4, 8)


def engine_max_sequences(gpu: Gpu) -> int:
    """The sequences vLLM's server batches at most by default on this GPU (`--max-num-seqs`): 1,024 on one
    of 70 GiB or more but an A100, else 256 (vllm/engine/arg_utils.py, vLLM 0.32)."""
    return 1024 if gpu.memory_gib >= 70 and "a100" not in gpu.name else 256


@dataclass(frozen=True)
class PerInstance:
    """What one instance of a build serves within the objective."""

    users: int  # concurrent users within the objective (0: not even one)
    output_tps: float  # output tokens/s at the highest-throughput load within the objective
    request_rps: float  # finished requests/s at that load
    e2e_s: float  # end-to-end latency (p50) at that load
    devices: int  # GPUs per instance (its tensor-parallel degree); 1 for a CPU machine
    measured: bool  # False: projected
    how: str  # one phrase: where it was measured, or what the projection assumed
    users_range: tuple[int, int] | None = None  # measured on intervals: users within the objective for certain
    # (low) and not missed (high); None where projected or the levels were not judged so
    at_least: str | None = None  # no level missed: `users` is a lower bound, and this is why the load went no
    # higher (eval/load/edge.py); the devices and costs resting on it are then upper bounds


@dataclass(frozen=True)
class Cost:
    """A build on one device kind, for the traffic; None where it cannot serve it (`why` says why)."""

    users_needed: float
    instances: int | None
    devices: int | None  # devices in all: device-hours per hour
    usd_per_hour: float | None  # None without a price
    usd_per_mtok: float | None  # $ per million output tokens
    usd_per_request: float | None
    why: str | None = None  # why it cannot serve the traffic (instances None)


def users_for_rate(rate_rps: float, e2e_s: float) -> float:
    """Little's law: the concurrent users a request rate keeps in flight at an end-to-end latency."""
    return rate_rps * e2e_s


def _within(
    levels: Mapping[int, LevelMetrics], users: int, devices: int, how: str, counts: Callable[[LevelMetrics], bool]
) -> PerInstance:
    """`users` per instance, at the throughput of the highest-throughput level up to them that `counts`."""
    within = [
        m for c, m in levels.items() if c <= users and counts(m) and m.output_tps and m.request_tps and m.e2e_ms_p50
    ]
    if not users or not within:
        return PerInstance(0, 0.0, 0.0, math.inf, devices, True, how)
    best = max(within, key=lambda m: m.output_tps or 0.0)
    return PerInstance(
        users, best.output_tps or 0.0, best.request_tps or 0.0, (best.e2e_ms_p50 or 0) / 1000, devices, True, how
    )


def measured(
    levels: Mapping[int, LevelMetrics], *, devices: int = 1, how: str, at_least: str | None = None
) -> PerInstance:
    """One instance as a sweep measured it: its users within the objective (the largest level that met it,
    every lower one meeting it too: eval/load/serving.py), and the throughput of the highest-throughput level
    among those; with the users' range where the levels were judged on intervals, and `at_least` where no
    level missed (the sweep's bound: a lower bound on the users)."""
    per = _within(levels, max_users_at_slo(dict(levels)), devices, how, lambda m: True)
    return replace(per, users_range=users_interval(dict(levels)), at_least=at_least)


def bounds(levels: Mapping[int, LevelMetrics], per: PerInstance) -> tuple[PerInstance, PerInstance] | None:
    """The conservative and optimistic ends of a measured instance (module docstring); None without a range."""
    if per.users_range is None:
        return None
    lo, hi = per.users_range
    sure = _within(levels, lo, per.devices, per.how, lambda m: m.slo_verdict == Verdict.PASS)
    maybe = _within(levels, hi, per.devices, per.how, lambda m: m.slo_verdict != Verdict.FAIL)
    return sure, maybe


@dataclass(frozen=True)
class AtSpeed:
    """One instance at a per-user speed, on the throughput-interactivity frontier its sweep traced."""

    user_tps: float  # output tokens/s each user gets
    users: float  # concurrent users at that speed (interpolated)
    output_tps: float  # output tokens/s per instance
    output_tps_range: tuple[float, float] | None  # its bootstrap interval, interpolated alike
    at_least: bool = False  # every level swept gave each user more: the best of them, a lower bound


def frontier(levels: Mapping[int, LevelMetrics]) -> list[tuple[int, LevelMetrics]]:
    """The levels that streamed tokens, fastest per user first: output tokens/s per instance against tokens/s
    per user (1 / median TPOT), the throughput-interactivity frontier (vLLM's `plot_pareto`, InferenceX)."""
    streamed = [(c, m) for c, m in levels.items() if m.output_tps and m.output_tps_per_user]
    return sorted(streamed, key=lambda cm: (-(cm[1].output_tps_per_user or 0.0), cm[0]))


def at_speed(levels: Mapping[int, LevelMetrics], user_tps: float) -> AtSpeed | None:
    """The instance at `user_tps` tokens/s per user: its users and throughput interpolated linearly in the
    per-user speed between the two frontier levels that bracket it (each end of the throughput's interval
    likewise). Where every level gave each user more than that, the highest throughput among them, marked a
    lower bound (more users would get less each, and the instance more in all); None where none gave each user
    that much (not even one user at a time)."""
    points = frontier(levels)
    if not points or (points[0][1].output_tps_per_user or 0.0) < user_tps:
        return None
    if (points[-1][1].output_tps_per_user or 0.0) > user_tps:
        c, m = max(points, key=lambda cm: cm[1].output_tps or 0.0)
        return AtSpeed(user_tps, c, m.output_tps or 0.0, m.output_tps_interval, at_least=True)
    for (c1, a), (c2, b) in itertools.pairwise(points):
        fast, slow = a.output_tps_per_user or 0.0, b.output_tps_per_user or 0.0
        if not slow <= user_tps <= fast:
            continue
        w = (fast - user_tps) / (fast - slow) if fast > slow else 0.0
        ends = None
        if a.output_tps_interval and b.output_tps_interval:
            (a_lo, a_hi), (b_lo, b_hi) = a.output_tps_interval, b.output_tps_interval
            ends = (_lerp(a_lo, b_lo, w), _lerp(a_hi, b_hi, w))
        return AtSpeed(user_tps, _lerp(c1, c2, w), _lerp(a.output_tps or 0.0, b.output_tps or 0.0, w), ends)
    return None


def _lerp(x: float, y: float, w: float) -> float:
    return x + w * (y - x)


def usd_per_mtok(usd_per_instance_hour: float, output_tps: float) -> float:
    """$ per million output tokens from an instance's price and its output tokens/s."""
    return usd_per_instance_hour / (output_tps * 3600) * 1e6


@dataclass(frozen=True)
class Projected:
    """The projection's figures at one load, for the tables that show how a projected cell was reached."""

    users: int
    tpot_s: float
    ttft_s: float
    max_sequences: int


def tensor_parallel(shape: Shape, weights: float, gpu: Gpu, context: int, a: Assumptions) -> int | None:
    """The fewest GPUs (1, 2, 4, 8) whose memory holds the weights and one sequence's KV cache."""
    for n in TP_DEGREES:
        if _kv_room(shape, weights, gpu, n, a) >= context * shape.kv_bytes_per_token(a.kv_dtype_bytes):
            return n
    return None


def _kv_room(shape: Shape, weights: float, gpu: Gpu, n: int, a: Assumptions) -> float:
    """Bytes left for the KV cache on `n` GPUs, each reserving its runtime and activation workspace."""
    reserve = a.runtime_reserve_gib * 2**30 + workspace_bytes(shape, a.prefill_tokens)
    per_gpu = gpu.memory_bytes * a.utilization - reserve
    return n * per_gpu - weights


def project(
    shape: Shape,
    precision: str,
    gpu: Gpu,
    *,
    weights: float,
    input_len: int,
    output_len: int,
    ttft_ms: float,
    tpot_ms: float,
    a: Assumptions,
    tp: int | None = None,
) -> tuple[PerInstance, Projected] | None:
    """One instance of the build on `tp` GPUs (the fewest that hold it, if None), projected: a decode step
    at c users takes the longer of its bytes over `a.mbu` of the GPUs' bandwidth and its FLOPs over `a.mfu` of
    their peak, the FLOPs counting c / output_len prompts' prefill (each request's prefill spread over its
    output steps, as chunked prefill mixes them in); TTFT is one prompt's prefill at `a.mfu` (no queueing);
    the users are the most whose TPOT and TTFT are within the objective, whose KV cache fits and that vLLM
    batches (engine_max_sequences). None where no degree holds one sequence."""
    context = input_len + output_len
    n = tp or tensor_parallel(shape, weights, gpu, context, a)
    if n is None:
        return None
    kv_tok = shape.kv_bytes_per_token(a.kv_dtype_bytes)
    max_seqs = min(
        engine_max_sequences(gpu), max(0, math.floor(_kv_room(shape, weights, gpu, n, a) / (context * kv_tok)))
    )
    bandwidth = n * gpu.bandwidth * a.mbu
    flops = n * gpu.compute_flops(precision) * a.mfu
    mid = mid_generation_context(input_len, output_len)
    token_flops = 2 * (shape.linear_params + shape.lm_head_params)
    prefill = token_flops * input_len + 2 * shape.layers * input_len**2 * shape.heads * shape.head_dim
    ttft = prefill / flops

    def tpot(c: int) -> float:
        step_flops = c * token_flops + c / output_len * prefill
        return max(
            decode_step_bytes(weights, shape.embedding_table_bytes, kv_tok, c, mid) / bandwidth, step_flops / flops
        )

    users = 0
    if ttft * 1000 <= ttft_ms and max_seqs >= 1 and tpot(1) * 1000 <= tpot_ms:
        lo, hi = 1, max_seqs  # the most users within the objective: TPOT grows with the users
        while lo < hi:
            mid_c = (lo + hi + 1) // 2
            lo, hi = (mid_c, hi) if tpot(mid_c) * 1000 <= tpot_ms else (lo, mid_c - 1)
        users = lo
    step = tpot(max(users, 1))
    e2e = ttft + (output_len - 1) * step
    how = f"projected at {a.mbu:.0%} of peak bandwidth and {a.mfu:.0%} of peak FLOP/s"
    per = PerInstance(users, users / step if users else 0.0, users / e2e if users else 0.0, e2e, n, False, how)
    return per, Projected(users, step, ttft, max_seqs)


def cost(per: PerInstance | None, users_needed: float, price_per_device_hour: float | None) -> Cost:
    """The instances and devices `users_needed` take, and their price; a build that cannot serve says why."""
    if per is None:
        return Cost(users_needed, None, None, None, None, None, "does not fit on 8 of these")
    if per.users == 0:
        return Cost(users_needed, None, None, None, None, None, "holds no user within the objective")
    instances = max(1, math.ceil(users_needed / per.users))
    devices = instances * per.devices
    if price_per_device_hour is None:
        return Cost(users_needed, instances, devices, None, None, None)
    instance_hour = price_per_device_hour * per.devices
    return Cost(
        users_needed,
        instances,
        devices,
        devices * price_per_device_hour,
        usd_per_mtok(instance_hour, per.output_tps),
        instance_hour / (per.request_rps * 3600),
    )
