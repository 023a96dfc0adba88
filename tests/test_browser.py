"""What the team sees: the MLflow UI over the store of a real (small) pipeline run, in headless Chromium.

Debian's chromium (installed by `make test`, scripts/install-chromium.sh) driven by Playwright. The test
starts where a user starts, at the address `qeval ui` prints; its screenshots are kept in test-artifacts/
(docs/img/ has copies, shown in docs/mlflow.md).
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
from helpers import REPO, root_env

from pipelines.core.card.cards import load_card
from pipelines.core.store.layout import gate_file
from pipelines.core.store.searches import with_carried
from pipelines.core.store.verdicts import BuildVerdict
from pipelines.core.system.procs import running

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
def ui(pipeline_root):
    """`qeval ui` on loopback over the store of the session's pipeline run (every stage logged, the gate and
    the report); yields the address it printed for the model, the decision and the card."""
    card = with_carried(load_card("ref-small"))  # its builds and the mix its search carried on, each a run
    SHOTS.mkdir(exist_ok=True)
    SHOTS_LOG.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pipelines", "ui", "--port", "{port}"]
    with running(cmd, SHOTS_LOG, 120, "qeval ui", root_env(pipeline_root)):
        printed = re.search(rf"^{card.name}: (http://\S+)$", SHOTS_LOG.read_text(), re.MULTILINE)
        assert printed, SHOTS_LOG.read_text()[-2000:]
        yield printed.group(1), json.loads(gate_file(card.name).read_text()), card


def _rows(page) -> dict[str, str]:
    """The runs table as the user sees it: run name -> the row's text (its cells, one per line)."""
    rows = {}
    for i in range(page.locator("[role=row][row-index]").count()):
        row = page.locator(f'[role=row][row-index="{i}"]')
        text = "\n".join(row.nth(k).inner_text() for k in range(row.count()))
        name = next((c for c in text.split("\n") if "@" in c or ": gate and report" in c), "?")
        rows[name] = rows.get(name, "") + text
    return rows


def test_the_address_qeval_ui_prints_opens_the_runs_table_with_every_verdict(ui):
    """From the address `qeval ui` prints, with no set-up: one row per build, each with its verdict, worst
    recovery, weights and speed in view; the chart view shows qeval's comparison charts."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: run scripts/install-chromium.sh (make test does)"
    url, decision, card = ui
    assert "workflowType=machine_learning" in url  # else MLflow 3 opens its GenAI overview, not the runs
    expected = {b["precision"]: b for b in decision["builds"]}

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})  # a fresh profile: no saved columns
        try:
            page.goto(url)
            for precision in card.precisions:
                page.get_by_text(f"{card.name}@{precision}", exact=True).wait_for(timeout=60_000)
            page.get_by_text("· recovery ", exact=False).first.wait_for(timeout=30_000)
            # the view widens the Description column once the grid has drawn
            description = "[role=columnheader][col-id='attributes.`Description`']"
            wide = "s => document.querySelector(s)?.getBoundingClientRect().width >= 350"
            page.wait_for_function(wide, arg=description)
            page.wait_for_timeout(1000)  # the last cells render
            page.screenshot(path=str(SHOTS / "mlflow-runs.png"))
            rows = _rows(page)
            # the comparison: the runs page's chart view, opened as a user does; the Assistant panel closed for room
            if (close := page.get_by_role("button", name="Close")).count():
                close.first.click()
            page.locator("label:has(input[name=runs-view-mode][value=CHART])").click()
            page.get_by_text("qeval: the decision").first.wait_for(timeout=30_000)
            page.wait_for_timeout(3000)  # the plots draw
            page.screenshot(path=str(SHOTS / "mlflow-charts.png"))
            charts = page.get_by_text("qeval: the decision").first.evaluate("e => e.parentElement.textContent")
            frontier = _artifact_image(page, url, f"{card.name}@{card.gate.baseline}", "report", "frontier.png")
        except Exception:
            page.screenshot(path=str(SHOTS / "mlflow-failed.png"), full_page=True)
            raise
        finally:
            browser.close()

    for precision in card.precisions:
        shown = rows.get(f"{card.name}@{precision}")
        assert shown, f"{precision}: no row in the runs table; rows: {list(rows)}"
        if precision == card.gate.baseline:
            assert "BASELINE" in shown
            continue
        build = expected[precision]
        assert build["verdict"] in shown, (precision, shown)
        worst = BuildVerdict.model_validate(build).worst_task()[1].recovery[0]  # the task that decides
        # the description's first 50 characters, in view: verdict, weights, worst recovery (the rest on hover)
        assert f"recovery {worst:.4f} [" in shown and " MB · " in shown, (precision, shown)
    assert len([n for n in rows if n.startswith(f"{card.name}@")]) == len(card.precisions)
    # both scatters and the parallel coordinates (the users bar only where a server was swept)
    assert int(re.search(r"\((\d+)\)", charts).group(1)) >= 3, charts
    # the throughput-interactivity frontier, drawn, on a swept build's own run (the report's frontier.png)
    assert frontier["width"] > 300 and frontier["height"] > 200, frontier


def _artifact_image(page, url: str, run: str, folder: str, name: str) -> dict:
    """As a user finds a chart on a run: the runs table, the run's name, its Artifacts tab, the folder, the
    file; the image's drawn size (0 where it did not load)."""
    page.goto(url)
    page.get_by_text(run, exact=True).first.click()
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text(folder, exact=True).first.click()
    page.get_by_text(name, exact=True).first.click()
    image = page.locator(f"img[alt='{folder}/{name}']").first  # MLflow's preview names the image by its path
    image.wait_for(timeout=30_000)
    page.wait_for_function("e => e.complete && e.naturalWidth > 0", arg=image.element_handle(), timeout=30_000)
    page.screenshot(path=str(SHOTS / f"mlflow-{name}"))
    return image.evaluate("e => ({width: e.naturalWidth, height: e.naturalHeight})")
