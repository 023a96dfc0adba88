"""Real lm-eval runs on the reference model's local tasks, logged to a real MLflow store."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
from mlflow.tracking import MlflowClient

from conftest import REPO
from eval.compare import recovery
from pipelines.errors import QevalError
from pipelines.evaluate import evaluate
from pipelines.tracking import Tracker, tracking_uri

pytestmark = pytest.mark.slow
TASKS = ("refkjv_ppl", "refkjv_next_verse", "refkjv_last_word")


@pytest.fixture
def evaluated(small_card, builds):
    """bf16 and fp8 of ref-small evaluated on 6 documents per task."""
    tracker = Tracker(small_card.name)
    return {p: evaluate(small_card, p, tracker, limit=6) for p in ("bf16", "fp8")}


def _raw(record) -> dict:
    return json.loads((record.path / "lm_eval_results.json").read_text())


def test_logged_metrics_equal_lm_evals_own_results(evaluated):
    client = MlflowClient(tracking_uri())
    for precision, record in evaluated.items():
        raw = _raw(record)
        run = client.get_run(record.run_id)
        assert run.info.run_name == f"ref-small@{precision}" and run.data.tags["qeval.stage.evaluate"] == "done"
        for task in TASKS:
            for key, value in raw["results"][task].items():
                if "," in key and isinstance(value, float):
                    name = f"eval/{task}/{key.split(',')[0]}"
                    assert run.data.metrics[name] == pytest.approx(value, rel=1e-12), name
        assert record.summary["n_samples"] == dict.fromkeys(TASKS, 6)
        assert run.data.params["eval.limit"] == "6"
        for task in TASKS:
            lines = (record.path / f"samples_{task}.jsonl").read_text().splitlines()
            assert len(lines) == 6 and "doc_id" in json.loads(lines[0])
    bpb = evaluated["bf16"].metrics["eval/refkjv_ppl/bits_per_byte"]
    assert math.log2(evaluated["bf16"].metrics["eval/refkjv_ppl/byte_perplexity"]) == pytest.approx(bpb, rel=1e-6)


def test_recovery_is_against_the_baseline_and_inverted_for_perplexity(evaluated):
    base, fp8 = (_raw(evaluated[p])["results"] for p in ("bf16", "fp8"))
    m = evaluated["fp8"].metrics
    assert m["recovery/refkjv_ppl/bits_per_byte"] == pytest.approx(
        base["refkjv_ppl"]["bits_per_byte,none"] / fp8["refkjv_ppl"]["bits_per_byte,none"]
    )
    assert m["recovery/refkjv_last_word/acc"] == pytest.approx(
        recovery(fp8["refkjv_last_word"]["acc,none"], base["refkjv_last_word"]["acc,none"], True)
    )
    assert not any(k.startswith("recovery/") for k in evaluated["bf16"].metrics)
    assert not any(k.startswith("recovery/") and "stderr" in k for k in m)


def test_task_data_is_logged_as_run_inputs_with_digests(evaluated):
    run = MlflowClient(tracking_uri()).get_run(evaluated["bf16"].run_id)
    inputs = {d.dataset.name: json.loads(d.dataset.source) for d in run.inputs.dataset_inputs}
    assert set(inputs) == set(TASKS)
    data = REPO / "eval/tasks/refkjv/last_word.jsonl"
    assert inputs["refkjv_last_word"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert evaluated["bf16"].summary["chance"]["refkjv_last_word"] == 0.25


def test_a_build_evaluated_unlike_its_baseline_is_refused(small_card, evaluated):
    with pytest.raises(QevalError, match="baseline was evaluated with other settings"):
        evaluate(small_card, "fp8", Tracker(small_card.name), limit=5)


def test_second_evaluation_is_skipped(small_card, evaluated):
    again = evaluate(small_card, "fp8", Tracker(small_card.name), limit=6)
    assert again.status == "skipped" and again.metrics == evaluated["fp8"].metrics
