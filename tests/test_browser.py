"""What the team sees: the MLflow UI over a store filled by a real (small) pipeline run, in headless Chromium.

Debian's chromium (installed by `make test`, scripts/install-chromium.sh) driven by Playwright. The
screenshot is kept in test-artifacts/ for people to look at.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO
from pipelines.cards import load_card
from pipelines.gate import gate
from pipelines.procs import running
from pipelines.report import report
from pipelines.results import gate_file
from pipelines.tracking import MlflowTracker, ui_command

pytestmark = pytest.mark.slow

SHOTS = REPO / "test-artifacts"
SHOTS_LOG = SHOTS / "mlflow-server.log"
# The closed network refuses Chromium's own background connections; keep it from trying.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def mlflow_server(own_root):
    """A real `mlflow server` on loopback over the small card's store, after the gate and the report."""
    from pipelines.bench import bench
    from pipelines.evaluate import evaluate
    from pipelines.quantize import quantize

    card = load_card("ref-small")
    tracker = MlflowTracker(card.name)
    for stage in (quantize, evaluate, bench):  # finished: logged to the fresh store
        for precision in card.precisions:
            stage(card, precision, tracker)
    report(card, gate(card, tracker), tracker)
    SHOTS.mkdir(exist_ok=True)
    with running(ui_command("127.0.0.1", "{port}"), SHOTS_LOG, 120, "mlflow server") as url:
        yield url, tracker.experiment_id, card


def _pick_columns(page, names: list[str], hide: list[str]) -> None:
    """Choose columns the way a user does: the Columns menu, its search box, one click per column."""
    page.get_by_role("button", name="Columns", exact=True).click()
    menu = page.get_by_role("dialog")
    search = menu.get_by_placeholder("Search columns")
    for name in hide + names:
        search.fill(name)
        menu.get_by_text(name, exact=True).first.click()  # first: the exact name, not a longer one
    page.keyboard.press("Escape")


def test_the_experiment_shows_one_run_per_precision_with_recovery_speed_and_verdict(mlflow_server):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: run scripts/install-chromium.sh (make test does)"
    url, experiment_id, card = mlflow_server
    decision = json.loads(gate_file(card.name).read_text())
    expected = {b["precision"]: b for b in decision["builds"]}

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 2200, "height": 900})
            SHOTS.mkdir(exist_ok=True)
            page.goto(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
            for precision in card.precisions:
                page.get_by_text(f"{card.name}@{precision}", exact=True).wait_for(timeout=60_000)
            _pick_columns(
                page,
                ["gate/recovery_worst", "gate/decode_tps", "qeval.gate.verdict"],
                hide=["Dataset", "Source", "Models"],
            )
            page.get_by_text("qeval.gate.verdict", exact=True).first.wait_for()
            page.screenshot(path=str(SHOTS / "mlflow-runs.png"), full_page=True)
            rows = {}
            for i in range(page.locator("[role=row][row-index]").count()):
                row = page.locator(f'[role=row][row-index="{i}"]')
                if row.count():
                    cells = "\n".join(row.nth(k).inner_text() for k in range(row.count())).split("\n")
                    rows.setdefault(next((c for c in cells if "@" in c), "?"), []).append(cells)
        except Exception:
            page.screenshot(path=str(SHOTS / "mlflow-runs-failed.png"), full_page=True)
            raise
        finally:
            browser.close()

    for precision in card.precisions:
        shown = rows.get(f"{card.name}@{precision}")
        assert shown and len(shown) == 1, f"{precision}: {len(shown or [])} rows in the runs table"
        cells = shown[0]
        numbers = [float(c) for c in cells if c.replace(".", "", 1).replace("e-", "", 1).isdigit()]
        if precision == card.gate.baseline:
            assert "BASELINE" in cells
            continue
        build = expected[precision]
        assert build["verdict"] in cells
        worst = min(t["recovery"][0] for t in build["tasks"].values())
        assert any(abs(n - worst) < 1e-9 for n in numbers), (precision, cells)
        assert any(abs(n - build["speed"]["decode_tps"]) < 1e-6 for n in numbers), (precision, cells)
