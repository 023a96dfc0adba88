"""How figures read: units, colours, progress lines."""

from __future__ import annotations

import logging
import time

from pipelines.core.store import formats as present
from pipelines.core.system import progress
from pipelines.tracking.mapping import build_run_tags
from pipelines.tracking.names import PARAM_PRECISION, TAG_RUN_COLOUR
from pipelines.tracking.tables import names
from pipelines.tracking.view import runs_view


def test_sizes_counts_and_times_read_in_sensible_units():
    assert present.size(0.006653) == "6.65 MB"
    assert present.size(16.06) == "16.1 GB"
    assert present.size(141.0) == "141 GB"
    assert present.count(155_068) == "> 10,000"
    assert present.count(1024) == "1,024"
    assert present.ms(0.00154) == "< 0.01"
    assert present.ms(12.345) == "12.3"
    assert present.ms(2341.7) == "2,342"


def test_a_precision_has_one_colour_and_precisions_differ():
    shown = {p: present.precision_colour(p) for p in ("bf16", "fp8", "int8", "awq", "gptq", "w8a16", "nvfp4")}
    five = list(shown.values())[:5]
    assert len(set(five)) == 5  # the five the pipeline builds never share a colour
    assert shown["w8a16"] not in five and shown["nvfp4"] not in five  # a precision added later gets a spare one
    # the MLflow run's colour is the chart's
    assert all(build_run_tags("m", p)[TAG_RUN_COLOUR] == colour for p, colour in shown.items())


def test_the_runs_view_names_only_what_qeval_logs():
    view = runs_view()
    known = names()
    metrics = set(known["metrics"])
    for column in view["selectedColumns"]:
        kind, name = column.split(".", 1)
        name = name.strip("`")
        assert name in {k: set(v) for k, v in known.items()}.get(kind, {"Description"}), column
    for chart in view["compareRunCharts"]:
        used = [chart.get("metricKey"), *(chart.get(a, {}).get("key") for a in ("xaxis", "yaxis"))]
        used += chart.get("selectedMetrics", [])
        assert {u for u in used if u} <= metrics, chart["displayName"]
        assert set(chart.get("selectedParams", [])) <= {PARAM_PRECISION}


def test_progress_lines_say_elapsed_estimate_and_step(caplog):
    assert progress.line("m@awq quantize", 75, 180, "GPTQ layer 3") == (
        "m@awq quantize: 1m15s, about 1m45s left; GPTQ layer 3"
    )
    assert progress.line("m@awq quantize", 200, 180, "") == "m@awq quantize: 3m20s, past the 3m00s estimate"
    assert progress.last_line("Tokenizing: 10%\rTokenizing: 55%\r") == ("Tokenizing: 55%", "")
    # a chunk that ends mid-line: its fragment waits for the rest (AWQ's progress once read "; , b")
    latest, rest = progress.last_line("Grid search: 5%|, best_error=4.6e-06]\rGrid search: 10%|, b")
    assert (latest, rest) == ("Grid search: 5%|, best_error=4.6e-06]", "Grid search: 10%|, b")
    assert progress.last_line(rest + "est_error=4.1e-06]\r")[0] == "Grid search: 10%|, best_error=4.1e-06]"
    assert progress.estimate("m", "evaluate", None) is None  # a fresh process (the fixture resets it)
    progress.finished("m", "evaluate", 100.0)
    progress.finished("m", "evaluate", 140.0)
    assert progress.estimate("m", "evaluate", None) == 120.0
    assert progress.estimate("m", "evaluate", 90.0) == 90.0  # this build's own last run wins
    with (
        caplog.at_level(logging.INFO, logger="pipelines.core.system.progress"),
        progress.heartbeat("m@int8 bench", None, 0.05),
    ):
        progress.step("\x1b[32mRunning loglikelihood requests:  45%\x1b[0m")
        time.sleep(0.2)
    assert any(r.getMessage().endswith("; Running loglikelihood requests: 45%") for r in caplog.records)


def test_card_text_in_the_ship_card_is_shown_as_written_not_acted_on(tmp_path, monkeypatch):
    """A source path holding `<img src=x onerror=alert(1)>` and Markdown reached the ship card, the registered
    version's description and the pulled README.md as is (issue 41)."""
    import yaml
    from helpers import REPO
    from markdown_it import MarkdownIt

    from pipelines.core.card.cards import ModelCard
    from pipelines.core.store.formats import literal
    from pipelines.present.shipcard import _what

    monkeypatch.setenv("QEVAL_WORKDIR", str(tmp_path))
    hostile = "models/<img src=x onerror=alert(1)> [x](javascript:alert(1)) ``tick`` *bold*\n# heading"
    data = yaml.safe_load((REPO / "pipelines/models/ref-lm.yaml").read_text())
    card = ModelCard.model_validate({**data, "source": {"path": hostile}})
    html = MarkdownIt().render("\n".join(_what(card, "int8")))
    assert "<img" not in html and "<a " not in html and "<strong>" not in html and "<h1>" not in html
    assert "&lt;img src=x onerror=alert(1)&gt; [x](javascript:alert(1)) ``tick`` *bold* # heading</code>" in html
    for text in ("plain", "`", "a ` b", "``x``"):
        assert MarkdownIt().render(literal(text)).strip() == f"<p><code>{text}</code></p>"
