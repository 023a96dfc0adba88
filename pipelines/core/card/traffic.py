"""A card's traffic and prices (`traffic:`), which the capacity and cost tables are computed for.

Peak concurrent users, or a peak request rate that Little's law turns into users at the scenario's
latency (eval/load/capacity.py); optionally the dollars per hour of one device of each kind (no built-in price
list: prices go stale and differ by contract, and without them the tables show device-hours); and the share
of a device's peak bandwidth a projection assumes where nothing was measured on it; and optionally the output
speed each user is to get, at which every build is priced on the frontier its sweep traced
(pipelines/decision/pricing.py).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipelines.core.card.names import CPU, DeviceName

# What a card's traffic may say: finite figures within bounds no deployment reaches, so that every count
# and dollar figure derived from them stays a number a table can print (a rate of 1e-300 requests per
# second, a price of 1e308 $/h or 10^30 users are typing errors, refused when the card is read).
MAX_USERS = 10_000_000
MIN_RATE_RPS, MAX_RATE_RPS = 0.001, 1_000_000.0
MIN_PRICE, MAX_PRICE = 0.01, 10_000.0  # $ per device-hour
MAX_USER_TPS = 100_000.0  # output tokens/s per user


class Traffic(BaseModel):
    """What the deployment must serve, and what its devices cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    users: Annotated[int, Field(ge=1, le=MAX_USERS)] | None = Field(None, description="peak concurrent users")
    rate_rps: float | None = Field(
        None,
        ge=MIN_RATE_RPS,
        le=MAX_RATE_RPS,
        allow_inf_nan=False,
        description="peak requests per second (instead of users)",
    )
    scenario: str | None = Field(None, description="the scenario the traffic is in; null: the card's main one")
    user_tps: float | None = Field(
        None,
        gt=0,
        le=MAX_USER_TPS,
        allow_inf_nan=False,
        description="output tokens/s each user is to get: every build priced on its frontier at that speed "
        "(matched interactivity); null: not priced so",
    )
    prices: dict[DeviceName, Annotated[float, Field(ge=MIN_PRICE, le=MAX_PRICE, allow_inf_nan=False)]] = Field(
        {}, description=f"$ per hour of one device, by GPU name (eval/devices/gpus.py) or '{CPU}'"
    )
    projected_mbu: float = Field(
        0.6, gt=0, le=1, description="share of peak bandwidth a projected decode reaches (no measurement there)"
    )
    projected_mfu: float = Field(0.5, gt=0, le=1, description="share of peak FLOP/s a projected prefill reaches")

    @model_validator(mode="after")
    def _one_load(self) -> Traffic:
        if (self.users is None) == (self.rate_rps is None):
            raise ValueError("give the peak load one way: users or rate_rps")
        return self
