"""What a build costs under the card's traffic (`traffic:`): the gate judges it (decision/inputs.py), the report
and the ship card show it (pipelines/present/capacity.py, frontier.py).

Per build, the cells of its capacity: the device a sweep ran on (measured: the serve stage's sweep of a real
checkpoint where it swept the traffic's scenario, else the shape stage's at random weights) and the card's GPUs
(projected from the size stage's bytes at the card's stated bandwidth share; eval/load/capacity.py), each the
devices the traffic needs within the scenario's objective and their price. Where the card states a per-user speed
(`traffic.user_tps`), every swept build priced at that speed on its throughput-interactivity frontier: what its
users would see, not its own edge, interpolated between the two levels that bracket it (`capacity.at_speed`); a
build whose every level gave each user more is priced at the best of them, as an upper bound on its cost, and one
whose no level gave each user that much is not priced there, and says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import eval.devices.gpus as gpus
import eval.load.capacity as capacity
from eval.devices.sizing import Shape
from eval.load.serving import LevelMetrics
from pipelines.core.card.cards import ModelCard, Scenario
from pipelines.core.card.traffic import CPU
from pipelines.core.framework.weights import architecture
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import AtShape, Served, Sized
from pipelines.core.store.verdicts import CostFigure
from pipelines.core.system.errors import QevalError


@dataclass(frozen=True)
class Cell:
    device: str  # "cpu" or a GPU's catalog name
    per: capacity.PerInstance | None  # None: no tensor-parallel degree holds the build
    cost: capacity.Cost
    price: float | None  # $ per device-hour, from the card
    bounds: tuple[capacity.Cost, capacity.Cost] | None = None  # measured on intervals: conservative, optimistic


Found = tuple[str, dict[int, LevelMetrics], str, str | None]


def measured_sweep(card: ModelCard, precision: str, name: str, sc: Scenario) -> Found | None:
    """(device, levels, how, why no edge was found) of the sweep that measured the build in this scenario: the
    serve stage's of the real checkpoint (its prompt possibly cut to the model's positions), else the shape
    stage's."""
    served = result_of(card.name, precision, Served)
    if served and served.vllm and served.load.output_len == sc.output_len and served.load.input_len <= sc.input_len:
        device = served.device or CPU
        how = f"measured: {served.engine_version or served.engine} sweep on {device}"
        return device, served.per_level, how, served.users_bound
    shaped = result_of(card.name, precision, AtShape)
    sweep = shaped.scenarios.get(name) if shaped else None
    if sweep is None:
        return None
    device = shaped.device or CPU
    probed = " (probed at one user: too slow to sweep)" if sweep.probe else ""
    how = f"measured: random weights at the shape, {shaped.engine_version} on {device}{probed}"
    return device, sweep.per_level, how, sweep.users_bound


def _shape(card: ModelCard) -> tuple[Shape | None, int | None]:
    """The model's shape and its positions; (None, None) where the card has no architecture this machine can
    read (a hub card without `source.config`): then nothing is projected."""
    try:
        shape, _, positions = architecture(card, "the capacity table")
    except QevalError:
        return None, None
    return shape, positions


def _needed(card: ModelCard, per: capacity.PerInstance | None) -> float:
    t = card.traffic
    if t.users is not None:
        return float(t.users)
    return capacity.users_for_rate(t.rate_rps, per.e2e_s) if per and per.users else 0.0


def _cell(
    card: ModelCard, device: str, per: capacity.PerInstance | None, levels: dict[int, LevelMetrics] | None = None
) -> Cell:
    price = card.traffic.prices.get(device)
    ends = capacity.bounds(levels, per) if levels is not None and per is not None else None
    costs = tuple(capacity.cost(p, _needed(card, p), price) for p in ends) if ends else None
    return Cell(device, per, capacity.cost(per, _needed(card, per), price), price, costs)


def traffic_scenario(card: ModelCard) -> tuple[str, Scenario, Shape | None]:
    """The traffic's scenario as the servers swept it (cut to the model's positions), and the model's shape."""
    name = card.traffic.scenario or card.speed.main_scenario[0]
    shape, positions = _shape(card)
    return name, card.scenarios_within(positions)[name][0], shape


def cells_of(card: ModelCard, precision: str) -> tuple[dict[str, Cell], dict[int, LevelMetrics] | None]:
    """One build's cells (the device it was swept on, then the GPUs it was sized for), and its measured levels."""
    t = card.traffic
    name, sc, shape = traffic_scenario(card)
    slo = card.speed.slo_of(sc)
    cells, levels = {}, None
    if found := measured_sweep(card, precision, name, sc):
        device, levels, how, bound = found
        cells[device] = _cell(card, device, capacity.measured(levels, how=how, at_least=bound), levels)
    sized = result_of(card.name, precision, Sized)
    if sized is not None and shape is not None:
        a = dataclasses.replace(sized.assumptions, mbu=t.projected_mbu, mfu=t.projected_mfu)
        for fit in sized.fits:
            if fit.gpu in cells:
                continue
            gpu = gpus.get_gpu(fit.gpu)
            if why := gpu.why_not(precision):  # not priced as if it ran: no kernel of the engine runs it there
                cost = capacity.Cost(_needed(card, None), None, None, None, None, None, f"no kernel runs it: {why}")
                cells[fit.gpu] = Cell(fit.gpu, None, cost, t.prices.get(fit.gpu))
                continue
            got = capacity.project(
                shape,
                precision,
                gpu,
                weights=sized.weights_bytes,
                input_len=sc.input_len,
                output_len=sc.output_len,
                ttft_ms=slo.ttft_ms,
                tpot_ms=slo.tpot_ms,
                a=a,
            )
            cells[fit.gpu] = _cell(card, fit.gpu, got[0] if got else None)
    return cells, levels


def cost_figure(card: ModelCard, precision: str) -> CostFigure | None:
    """The build's cost for the card's traffic on the device the gate judges cost on (None: no traffic, or
    neither measured nor sized there)."""
    if card.traffic is None:
        return None
    cell = cells_of(card, precision)[0].get(card.cost_device)
    if cell is None:
        return None
    c, per = cell.cost, cell.per
    users = per.users if per else 0
    ends = cell.bounds
    return CostFigure(
        device=cell.device,
        measured=bool(per and per.measured),
        users_per_instance=users,
        devices=c.devices,
        usd_per_hour=c.usd_per_hour,
        usd_per_mtok=c.usd_per_mtok,
        why=c.why,
        at_most=per.at_least if per else None,
        devices_range=(ends[1].devices, ends[0].devices) if ends else None,
        usd_per_mtok_range=(ends[1].usd_per_mtok, ends[0].usd_per_mtok)
        if ends and c.usd_per_mtok is not None
        else None,
    )


@dataclass(frozen=True)
class Priced:
    """One build at the card's per-user speed."""

    precision: str
    device: str
    at: capacity.AtSpeed | None  # None: its levels do not bracket the speed (`why`)
    usd_per_mtok: tuple[float, float | None, float | None] | None  # point, and the interval's ends (cheap, dear)
    why: str = ""


Sweeps = dict[str, tuple[str, dict[int, LevelMetrics]]]


def _scenario(card: ModelCard) -> tuple[str, Scenario]:
    """The scenario the frontier is traced in: the traffic's (the card's main one without traffic)."""
    if card.traffic is not None:
        name, sc, _ = traffic_scenario(card)
        return name, sc
    return card.speed.main_scenario


def sweeps(card: ModelCard) -> Sweeps:
    """Per build with a measured sweep in the traffic's scenario (the card's main one without traffic): its
    device and levels."""
    name, sc = _scenario(card)
    found = {p: measured_sweep(card, p, name, sc) for p in card.precisions}
    return {p: (f[0], f[1]) for p, f in found.items() if f and capacity.frontier(f[1])}


def priced(card: ModelCard, swept: Sweeps) -> list[Priced]:
    """Every swept build (`sweeps`) at the card's `traffic.user_tps`; empty where the card states none."""
    if card.traffic is None or card.traffic.user_tps is None:
        return []
    return [_price(card, p, device, levels) for p, (device, levels) in swept.items()]


def _price(card: ModelCard, precision: str, device: str, levels: dict[int, LevelMetrics]) -> Priced:
    """One build at the card's per-user speed on the levels of its sweep on `device`."""
    at = capacity.at_speed(levels, card.traffic.user_tps)
    if at is None:
        best = max(m.output_tps_per_user or 0.0 for _, m in capacity.frontier(levels))
        why = f"no level swept gives each user that much (at most {best:.3g} tokens/s)"
        return Priced(precision, device, None, None, why)
    price = card.traffic.prices.get(device)
    usd = None
    if price is not None and at.output_tps > 0:
        ends = at.output_tps_range
        dear, cheap = (capacity.usd_per_mtok(price, x) if x > 0 else None for x in ends) if ends else (None, None)
        usd = (capacity.usd_per_mtok(price, at.output_tps), cheap, dear)
    return Priced(precision, device, at, usd, "" if price is not None else f"no price for {device} in the card")


def with_speed(card: ModelCard, precision: str, cost: CostFigure | None) -> CostFigure | None:
    """The build's cost figure with its cost at the card's per-user speed added, on the device the figure is
    for (what the gate judges wherever the card states that speed; unchanged where it states none)."""
    if cost is None or card.traffic is None or card.traffic.user_tps is None:
        return cost
    name, sc = _scenario(card)
    found = measured_sweep(card, precision, name, sc)
    if not found or found[0] != cost.device or not capacity.frontier(found[1]):
        # projected: no frontier to read a speed on, so the edge the projection found is what is judged
        why = f"not priced at {card.traffic.user_tps:g} tokens/s per user: no sweep on {cost.device}, its edge judged"
        return replace(cost, at_speed_why=why)
    r = _price(card, precision, found[0], found[1])
    return replace(
        cost,
        user_tps=card.traffic.user_tps,
        at_speed=r.usd_per_mtok,
        at_speed_bound=bool(r.at and r.at.at_least),
        at_speed_why=r.why or None,
        too_slow=r.at is None,
    )
