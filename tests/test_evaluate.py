"""A real lm-eval run on the embedded reference model, logged to a real MLflow store."""

from __future__ import annotations

import json
import math

import pytest
from mlflow.tracking import MlflowClient

from pipelines.cards import load_card
from pipelines.evaluate import evaluate
from pipelines.tracking import Tracker, tracking_uri

pytestmark = pytest.mark.slow


def test_baseline_accuracy_is_logged_exactly_as_lm_eval_reports_it(workdir):
    card = load_card("ref-lm")
    record = evaluate(card, "bf16", Tracker("ref-lm"), limit=4)
    assert record.status == "done" and record.summary["n_samples"] == {"refkjv_ppl": 4}

    raw = json.loads((record.path / "lm_eval_results.json").read_text())["results"]["refkjv_ppl"]
    run = MlflowClient(tracking_uri()).get_run(record.run_id)
    for metric in ("bits_per_byte", "byte_perplexity", "word_perplexity"):
        assert run.data.metrics[f"eval/refkjv_ppl/{metric}"] == pytest.approx(
            raw[f"{metric},none"], rel=1e-12
        )
    # bits per byte and byte perplexity are the same quantity in two units
    bpb = run.data.metrics["eval/refkjv_ppl/bits_per_byte"]
    assert math.log2(run.data.metrics["eval/refkjv_ppl/byte_perplexity"]) == pytest.approx(bpb, rel=1e-6)
    assert run.info.run_name == "ref-lm@bf16" and run.data.tags["qeval.stage.evaluate"] == "done"
    assert run.data.params["eval.limit"] == "4"
    samples = (record.path / "samples_refkjv_ppl.jsonl").read_text().splitlines()
    assert len(samples) == 4 and "doc_id" in json.loads(samples[0])

    again = evaluate(card, "bf16", Tracker("ref-lm"), limit=4)
    assert again.status == "skipped" and again.metrics == record.metrics
