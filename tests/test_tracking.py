"""The MLflow contract: names from typed results (pure), the list of them in docs/mlflow.md, and a real store."""

from __future__ import annotations

import multiprocessing as mp
import re

import pytest
from helpers import REPO, accuracy_result

from eval.bench.engine import EngineConfig
from eval.load.loadgen import LoadSettings
from eval.quality.accuracy import AccuracyConfig
from eval.quality.records import Metric
from pipelines.core.framework.registry import STAGES
from pipelines.core.store.results import Evaluated, Quantized, StageResult, VllmSettings
from pipelines.core.store.results.logs import Logs
from pipelines.core.system.errors import QevalError
from pipelines.core.system.net import redact
from pipelines.tracking.mapping import logged
from pipelines.tracking.names import MAX_DESCRIPTION
from pipelines.tracking.store import tracking_uri
from pipelines.tracking.tables import names
from quant.build import QuantizeConfig
from quant.recipes import IGNORE
from quant.verify import VerifyConfig


def _evaluated(recovery=None) -> Evaluated:
    scores = {
        "ppl": [Metric(name="bits_per_byte", value=1.5, higher_is_better=False)],
        "arc": [Metric(name="acc", value=0.5, stderr=0.01)],
        "gsm8k": [Metric(name="exact_match", filter="strict-match", value=0.3, stderr=0.02)],
    }
    accuracy = accuracy_result(scores)
    config = AccuracyConfig(checkpoint="c", tasks=["ppl"], num_fewshot=0, batch_size=8, seed=1, softmax_dtype="float64")
    return Evaluated(config=config, accuracy=accuracy, task_data_sha256=None, recovery=recovery)


def test_evaluate_names_follow_the_contract():
    out = logged(_evaluated({"arc": {"acc": 0.9}, "gsm8k": {"exact_match/strict-match": float("inf")}}))
    assert out.metrics == {
        "eval/ppl/bits_per_byte": 1.5,
        "eval/arc/acc": 0.5,
        "eval/arc/acc_stderr": 0.01,
        "eval/gsm8k/exact_match/strict-match": 0.3,
        "eval/gsm8k/exact_match_stderr/strict-match": 0.02,
        "recovery/arc/acc": 0.9,  # an infinite recovery (x / 0) is not a metric MLflow can hold
    }
    assert all("," not in k for k in out.metrics)
    # every setting that changes a result is a param, softmax_dtype among them
    assert out.params["eval.softmax_dtype"] == "float64" and out.params["eval.task_data_sha256"] == "hub"
    assert out.params["eval.backend"] == "hf" and out.params["eval.limit"] == "None"


def test_every_stage_declares_what_it_logs():
    """A stage added to the registry without saying what its result logs fails here, not at a run's end."""
    assert all(isinstance(s.result.LOGS, Logs) for s in STAGES.values())

    class Undeclared(StageResult):
        STAGE = "undeclared"

    with pytest.raises(TypeError, match="no MLflow declaration for Undeclared"):
        logged(Undeclared())


def test_every_setting_of_a_stage_is_a_param_or_said_not_to_be_one():
    declared = [s for spec in STAGES.values() for s in spec.result.LOGS.settings]
    for s in declared:
        assert set(s.params) | set(s.unlogged) == set(s.kind.model_fields), s.kind.__name__
        assert not set(s.params) & set(s.unlogged), s.kind.__name__
    kinds = {s.kind for s in declared}
    assert {QuantizeConfig, VerifyConfig, AccuracyConfig, EngineConfig, VllmSettings, LoadSettings} <= kinds


def test_the_scheme_says_the_cards_group_size():
    from pipelines.core.card.cards import load_card
    from quant.precisions import get_precision

    cfg = QuantizeConfig(base="b", precision="gptq", group_size=64, ignore=list(IGNORE))
    scheme = get_precision("gptq").describe(cfg.group_size)
    params = logged(Quantized(checkpoint="x", checkpoint_bytes=1, scheme=scheme, config=cfg)).params
    assert params["quant.scheme"] == "GPTQ 4-bit symmetric weights, group 64, 16-bit activations"
    assert params["quant.group_size"] == "64"
    fp8 = QuantizeConfig(base="b", precision="fp8", group_size=128, ignore=list(IGNORE))
    assert logged(Quantized(checkpoint="x", checkpoint_bytes=1, scheme="s", config=fp8)).params["quant.group_size"] == (
        "per-channel"
    )
    assert load_card("ref-lm").quantization.group_size == 128


def _layout_names() -> set[str]:
    """Backticked MLflow names in docs/mlflow.md's "MLflow layout" section; `a_p50|p90` lists siblings."""
    text = (REPO / "docs/mlflow.md").read_text()
    section = text[text.index("## MLflow layout\n") :]
    end = section.find("\n## ", 1)  # the next section, if the layout is not the page's last
    section = section if end < 0 else section[:end]
    names = set()
    for token in re.findall(r"`([^`\s]+)`", section):
        first, *more = token.split("|")
        names.add(first)
        names |= {first.rsplit("_", 1)[0] + "_" + m for m in more}
    return names


def test_the_mlflow_layout_lists_every_name_and_no_other():
    ours = {n for kind in names().values() for n in kind}
    shown = _layout_names()
    prefixes = r"(eval|recovery|quant|size|engine|mem|server|shape|gate|cost|qeval)[/.]"
    name_like = {n for n in shown if re.match(prefixes, n) and not re.search(r"\.(json|csv|png|md|log|yaml)$", n)}
    assert ours - shown == set(), "declared (names()), not in docs/mlflow.md"
    assert name_like - ours == set(), "in docs/mlflow.md, not declared (names())"
    assert {"qeval.stage.<stage>", "qeval.gate.verdict"} <= shown


def test_default_store_is_sqlite_under_mlruns(workdir, monkeypatch):
    assert tracking_uri() == f"sqlite:///{workdir / 'mlruns' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri() == "http://127.0.0.1:5999"


def test_redact_hides_credentials():
    assert redact("https://alice:s3cret@mlflow.example:8443/x") == "https://***@mlflow.example:8443/x"
    assert redact("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"


@pytest.mark.integration
def test_experiment_and_run_follow_the_contract(workdir):
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.mlflow_tracker import MlflowTracker

    tracker = MlflowTracker("tiny")
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

    from pipelines.tracking.mlflow_tracker import MlflowTracker

    os.environ["QEVAL_WORKDIR"] = workdir
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    return MlflowTracker(f"m{i % 2}").build_run(f"p{i}")


@pytest.mark.integration
@pytest.mark.new_store
def test_many_processes_can_create_the_store_at_once(workdir):
    with mp.get_context("spawn").Pool(6) as pool:
        run_ids = pool.map(_open_store, [(str(workdir), i) for i in range(6)])
    assert len(set(run_ids)) == 6


@pytest.mark.integration
def test_unwritable_store_is_one_clear_error(workdir, monkeypatch):
    from pipelines.tracking.mlflow_tracker import MlflowTracker

    blocker = workdir / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{blocker}/mlflow.db")
    with pytest.raises(QevalError, match=r"MLflow store sqlite:///.*a-file/mlflow.db is not usable: .*writable"):
        MlflowTracker("tiny")


def test_a_long_ship_card_is_cut_to_what_the_registry_keeps():
    from pipelines.tracking.mlflow_tracker import _description

    assert _description("# short card\n", "why", "r1") == "# short card\n"
    assert _description("", "the cheapest", "r1") == "Chosen by the gate: the cheapest"
    cut = _description("# card\n" + "x" * 9000, "why", "r1")
    assert len(cut) == MAX_DESCRIPTION and cut.startswith("# card") and cut.endswith("ship/README.md on run r1)")
