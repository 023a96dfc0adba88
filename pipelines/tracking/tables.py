"""The gate's tables (metric name -> how a build's verdict gives the figure) and `names()`, every MLflow name qeval
writes (docs/mlflow.md, "MLflow layout", lists them; tests/test_tracking.py holds the two to each other). What each
stage's result logs is declared beside the result type (pipelines/core/store/results/, its `LOGS`).
"""

from __future__ import annotations

from pipelines.core.framework.registry import STAGES
from pipelines.core.store.results.logs import Getter, templated
from pipelines.tracking.names import (
    EXPERIMENT,
    GATE_PARAM,
    GATE_RECOVERY_WORST,
    GATE_RECOVERY_WORST_LOWER,
    GATE_SPEED,
    GATE_USERS_AT_SLO,
    GATE_WEIGHTS_GB,
    PARAM_PRECISION,
    TAG_CHOSEN,
    TAG_COMMIT,
    TAG_DESCRIPTION,
    TAG_DIGESTS,
    TAG_DIRTY,
    TAG_FILES,
    TAG_KIND,
    TAG_MODEL,
    TAG_NOT_RUN,
    TAG_PRECISION,
    TAG_REASONS,
    TAG_RUN_COLOUR,
    TAG_SHIPS,
    TAG_STAGE,
    TAG_STAGE_ERROR,
    TAG_SUPERSEDED,
    TAG_VERDICT,
    TAG_VIEW,
)

GATE_METRICS: dict[str, Getter] = {  # on every build's run, from its verdict
    GATE_RECOVERY_WORST: lambda b: b.worst_task()[1].recovery[0] if b.tasks else 1.0,
    GATE_RECOVERY_WORST_LOWER: lambda b: b.worst_task()[1].recovery[1] if b.tasks else None,
    "gate/speedup": lambda b: b.speedup,
    GATE_SPEED: lambda b: b.speed.speed,  # the figure the speed rule used, in the card's regime
    GATE_WEIGHTS_GB: lambda b: b.speed.weights_gb,
    "gate/peak_gb": lambda b: b.speed.peak_gb,
    "gate/decode_tps": lambda b: b.speed.decode_tps,
    "gate/goodput_rps": lambda b: b.speed.goodput,
    GATE_USERS_AT_SLO: lambda b: b.speed.users_at_slo,
    # the card's traffic on the device the gate judges cost on (pipelines/decision/pricing.py)
    "cost/usd_per_mtok": lambda b: b.speed.cost.usd_per_mtok if b.speed.cost else None,
    "cost/usd_per_hour": lambda b: b.speed.cost.usd_per_hour if b.speed.cost else None,
    "cost/devices": lambda b: b.speed.cost.devices if b.speed.cost else None,
    "cost/users_per_instance": lambda b: b.speed.cost.users_per_instance if b.speed.cost else None,
    "cost/measured": lambda b: float(b.speed.cost.measured) if b.speed.cost else None,  # 1 measured, 0 projected
    "cost/at_most": lambda b: b.speed.cost and float(bool(b.speed.cost.at_most)),  # 1: no level missed, upper bounds
    "cost/usd_per_mtok_lo": lambda b: b.speed.cost and b.speed.cost.mtok_end(0),  # the range's optimistic end
    "cost/usd_per_mtok_hi": lambda b: b.speed.cost and b.speed.cost.mtok_end(1),  # and its conservative one
    "cost/judged": lambda b: b.speed.cost and b.speed.cost.judged,  # what the gate judges (CostFigure.judged)
}
GATE_TASK = "gate/{task}/"
GATE_GENERATION: dict[str, Getter] = {  # GATE_TASK + name, per generative task, from its `Generation`
    "length_ratio": lambda g: g.length.ratio[0],  # its total output tokens over the baseline's
    "length_ratio_lower": lambda g: g.length.ratio[1],
    "length_ratio_upper": lambda g: g.length.ratio[2],
    "departure_median": lambda g: g.departures.median,  # among the outputs that depart from the baseline's
    "identical_share": lambda g: g.departures.identical / len(g.departures.positions),
}
GATE_FLIPS: dict[str, Getter] = {  # GATE_TASK + name, per multiple-choice task, from its `Flips`
    "flip_rate": lambda f: f.rate[0],  # the share of answers that differ from the baseline's
    "flip_rate_lower": lambda f: f.rate[1],
    "flip_rate_upper": lambda f: f.rate[2],
}


def names() -> dict[str, list[str]]:
    """Every MLflow name qeval writes, by kind, as docs/mlflow.md ("MLflow layout") lists them: the stage registry's
    result types' (each declares its own, pipelines/core/store/results/logs.py), the gate's and the tags."""
    logs = [spec.result.LOGS for spec in STAGES.values()]
    return {
        "experiment": [EXPERIMENT],
        "metrics": [
            *(n for one in logs for n in one.names("metrics")),
            *GATE_METRICS,
            *(templated(GATE_TASK + n) for n in (*GATE_GENERATION, *GATE_FLIPS)),
        ],
        "series": [n for one in logs for n in one.names("series")],
        "params": sorted({*(n for one in logs for n in one.names("params")), templated(GATE_PARAM), PARAM_PRECISION}),
        "tags": [
            TAG_DESCRIPTION,
            TAG_RUN_COLOUR,
            TAG_MODEL,
            TAG_PRECISION,
            TAG_KIND,
            TAG_SUPERSEDED,
            TAG_VERDICT,
            TAG_REASONS,
            TAG_CHOSEN,
            TAG_SHIPS,
            TAG_COMMIT,
            TAG_DIRTY,
            TAG_DIGESTS,
            *(templated(t) for t in (TAG_STAGE, TAG_STAGE_ERROR, TAG_NOT_RUN)),
            TAG_VIEW,
            TAG_FILES,
        ],
    }
