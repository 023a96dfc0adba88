"""Where a server's load meets its latency objective's edge: the levels a sweep adds after its grid, and the
requests each level needs (pure functions and the card's settings for them).

The grid (1, 4, 16 users, say) leaves the edge somewhere between the last level that meets the objective and
the first that misses it. Bisection on concurrency narrows that gap: the next level is the middle of the
widest gap between judged levels from the largest level met (every level below it met too) to the first
level missed, until no gap is wider than `tolerance` users, the card's levels are spent, or its time is.
Levels judged too close to call (INCONCLUSIVE: eval/load/serving.py) stay inside the range, so the search narrows
both ends of "users within the objective" rather than betting on one side.

Where no level of the grid misses, the edge lies past it: the load is doubled from the highest level judged
(GuideLLM's goodput profile does the same) until a level misses, then bisected as above. The raise stops at a
bound: the card's `max_users`, the sequences the server has room for, the load generator's own ceiling, the
sweep's levels or time. A search that stops so before any level missed has found no edge, and its figure is a
lower bound ("at least 64 users"), said wherever it is shown, never the grid's top passed off as measured.

A level's verdict rests on its p95s' intervals, which narrow as it gets more requests: a level gets another
round of `requests_per_user` per user while either interval is wider than `interval_share` of its objective,
up to `max_requests_per_user`, within the same time bound; the level says which of the three stopped it. A
level that misses the objective wholly gets no more: a narrower interval would not change that.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from eval.quality.stats import Verdict

MAX_EXTRA_LEVELS = 32  # a bisection over 4,096 users needs 12


class EdgeSearch(BaseModel):
    """How far a sweep goes past its grid to find the objective's edge, and how many requests a level gets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    levels: int = Field(
        3,
        ge=0,
        le=MAX_EXTRA_LEVELS,
        description="concurrency levels added after the grid, bisecting toward the objective's edge (0: none)",
    )
    tolerance: int = Field(1, ge=1, description="stop when no gap between judged levels is wider (users)")
    interval_share: float = Field(
        0.1, gt=0, le=1, description="more requests at a level while a p95's interval is wider than this share"
    )
    max_requests_per_user: int = Field(12, ge=1, description="requests per user a level gets at most")
    max_s: float = Field(
        120, gt=0, description="a sweep's time after which it adds no request or level (the grid runs whole)"
    )
    max_users: int = Field(
        256, ge=1, description="where no level misses, the load is doubled past the grid up to this many users"
    )


def next_level(verdicts: Mapping[int, Verdict], tolerance: int, limit: int = 0) -> int | None:
    """The next concurrency to judge, or None when the edge is found within `tolerance` users. Where no level
    missed the objective, twice the highest level judged, at most `limit` users (None at the limit)."""
    levels = sorted(verdicts)
    missed = next((c for c in levels if verdicts[c] == Verdict.FAIL), None)
    if missed is None:
        return min(2 * levels[-1], limit) if levels and levels[-1] < limit else None
    met = 0  # the largest level met with every level below it met
    for c in levels:
        if verdicts[c] != Verdict.PASS:
            break
        met = c
    points = [met, *(c for c in levels if met < c < missed), missed]
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(points) if b - a > tolerance]
    if not gaps:
        return None
    _, a, b = max(gaps)
    return (a + b) // 2


def too_wide(interval: tuple[float, float] | None, objective: float, share: float) -> bool:
    """A p95 interval wider than `share` of its objective (an unmeasured one is not: more requests of the same
    kind would not measure it)."""
    return interval is not None and interval[1] - interval[0] > share * objective


SIZED = "p95 intervals within {share:.0%} of the objective"
MISSED = "missed wholly"
CAPPED = "stopped at the card's {n} requests per user"
TIMED = "stopped at the card's {s:g} s for a sweep"

# Why the load was raised no further though no level missed (the figure is then a lower bound)
AT_USERS = "the card's edge.max_users ({n})"
AT_ROOM = "the server's room for {n} sequences of this length"
AT_GENERATOR = "the load generator's ceiling ({chunks:.0f} chunks/s, under 10x the server's {tps:.0f} tokens/s)"
AT_CEILING = "the {n} users the load generator's ceiling was measured at"
AT_LEVELS = "the card's edge.levels ({n} added)"
AT_TIME = "the card's edge.max_s ({s:g} s)"
AT_GRID = "the grid's top (no search past it)"
