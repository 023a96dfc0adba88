"""The MLflow runs page as a decision needs it: qeval's saved view, and the address that opens it.

The view is MLflow's own "shared view" (MLflow 3.17, experiment page): the runs page's state as JSON in
the experiment tag `mlflow.sharedViewState.<key>`, applied when the URL carries `viewStateShareKey=<key>`.
"""

from __future__ import annotations

from typing import Any

from pipelines.tracking.names import (
    GATE_RECOVERY_WORST,
    GATE_RECOVERY_WORST_LOWER,
    GATE_SPEED,
    GATE_USERS_AT_SLO,
    GATE_WEIGHTS_GB,
    PARAM_PRECISION,
    TAG_VERDICT,
    VIEW_KEY,
)


def runs_view() -> dict[str, Any]:
    """The runs page as a decision needs it, stored as MLflow's shared view (experiment tag TAG_VIEW) and
    opened by `view_url()`: the decision's columns in the table, and charts of quality against weights and
    speed. The keys are the UI's own view state (MLflow 3.17, experiment page: "selectedColumns",
    "compareRunCharts" with chart types SCATTER, BAR and PARALLEL)."""
    section = "qeval-decision"
    columns = [
        "attributes.`Description`",
        f"params.`{PARAM_PRECISION}`",
        f"tags.`{TAG_VERDICT}`",
        *(
            f"metrics.`{m}`"
            for m in (GATE_RECOVERY_WORST, GATE_RECOVERY_WORST_LOWER, GATE_WEIGHTS_GB, GATE_SPEED, GATE_USERS_AT_SLO)
        ),
    ]

    def chart(uuid: str, kind: str, name: str, **spec: Any) -> dict[str, Any]:
        return {
            "uuid": uuid,
            "type": kind,
            "displayName": name,
            "metricSectionId": section,
            "deleted": False,
            "isGenerated": False,
            "runsCountToCompare": 100,
            **spec,
        }

    def axis(metric: str) -> dict[str, str]:
        return {"key": metric, "type": "METRIC"}

    charts = [
        chart(
            "qeval-quality-weights",
            "SCATTER",
            "worst recovery against weights (GB)",
            xaxis=axis(GATE_WEIGHTS_GB),
            yaxis=axis(GATE_RECOVERY_WORST),
        ),
        chart(
            "qeval-quality-speed",
            "SCATTER",
            "worst recovery against the gate's speed figure",
            xaxis=axis(GATE_SPEED),
            yaxis=axis(GATE_RECOVERY_WORST),
        ),
        chart("qeval-users", "BAR", "concurrent users within the latency objective", metricKey=GATE_USERS_AT_SLO),
        chart(
            "qeval-parallel",
            "PARALLEL",
            "precision, quality, weights, speed",
            selectedParams=[PARAM_PRECISION],
            selectedMetrics=[GATE_RECOVERY_WORST, GATE_WEIGHTS_GB, GATE_SPEED],
        ),  # every regime has these
    ]
    sections = [
        {
            "uuid": section,
            "name": "qeval: the decision",
            "display": True,
            "isReordered": True,
            "deleted": False,
            "isGenerated": False,
        }
    ]
    fixed = ["attributes.`Run Name`", "runDateAndNestInfo", "duration"]  # the UI's own column ids
    return {
        "selectedColumns": columns,
        "columnOrder": fixed + columns,
        "columnWidths": {"attributes.`Description`": 380},  # the UI shows 50 characters of it
        "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": charts,
        "compareRunSections": sections,
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
    }


def view_url(base: str, experiment_id: str) -> str:
    """The runs table of an experiment with qeval's view, in the MLflow UI at `base`: the experiment's own
    page opens MLflow's GenAI overview; `workflowType=machine_learning` opens the runs table instead."""
    query = f"workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"
