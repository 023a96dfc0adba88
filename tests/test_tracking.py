from __future__ import annotations

import multiprocessing as mp

import pytest
from mlflow.tracking import MlflowClient

from pipelines.errors import QevalError
from pipelines.tracking import Tracker, lm_eval_metrics, metric_key, redact, tracking_uri


def test_metric_key_translates_lm_eval_names():
    assert metric_key("arc_easy", "acc,none") == "eval/arc_easy/acc"
    assert metric_key("arc_easy", "acc_stderr,none") == "eval/arc_easy/acc_stderr"
    assert metric_key("gsm8k", "exact_match,strict-match") == "eval/gsm8k/exact_match/strict-match"
    assert metric_key("wikitext", "alias") is None


def test_lm_eval_metrics_flattens_and_drops_non_numbers():
    results = {
        "refkjv_ppl": {"alias": "refkjv_ppl", "bits_per_byte,none": 1.5, "bits_per_byte_stderr,none": "N/A"},
        "arc_easy": {"acc,none": 0.5, "acc_stderr,none": 0.01, "samples": 10, "flag,none": True},
    }
    assert lm_eval_metrics(results) == {
        "eval/refkjv_ppl/bits_per_byte": 1.5,
        "eval/arc_easy/acc": 0.5,
        "eval/arc_easy/acc_stderr": 0.01,
    }
    assert all("," not in k for k in lm_eval_metrics(results))


def test_default_store_is_sqlite_under_mlruns(workdir, monkeypatch):
    assert tracking_uri() == f"sqlite:///{workdir / 'mlruns' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri() == "http://127.0.0.1:5999"


def test_redact_hides_credentials():
    assert redact("https://alice:s3cret@mlflow.example:8443/x") == "https://***@mlflow.example:8443/x"
    assert redact("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"


def test_experiment_and_run_follow_the_contract(workdir):
    tracker = Tracker("tiny")
    run_id = tracker.build_run("fp8")
    assert tracker.build_run("fp8") == run_id  # the same build reuses its run
    client = MlflowClient(tracking_uri())
    exp = client.get_experiment_by_name("qeval/tiny")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.artifact_location.endswith(str(workdir / "mlruns" / "artifacts" / "tiny"))
    run = client.get_run(run_id)
    assert run.info.run_name == "tiny@fp8"
    assert run.data.tags["qeval.model"] == "tiny" and run.data.tags["qeval.precision"] == "fp8"


def _open_store(args):
    workdir, i = args
    import os

    os.environ["QEVAL_WORKDIR"] = workdir
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    tracker = Tracker(f"m{i % 2}")
    return tracker.build_run(f"p{i}")


def test_many_processes_can_create_the_store_at_once(workdir):
    with mp.get_context("spawn").Pool(6) as pool:
        run_ids = pool.map(_open_store, [(str(workdir), i) for i in range(6)])
    assert len(set(run_ids)) == 6


def test_unwritable_store_is_one_clear_error(workdir, monkeypatch):
    blocker = workdir / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{blocker}/mlflow.db")
    with pytest.raises(QevalError, match=r"MLflow store sqlite:///.*a-file/mlflow.db is not usable: .*writable"):
        Tracker("tiny")
