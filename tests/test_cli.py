"""The `qeval` command as a user runs it: a real process, its exit status, its last line."""

from __future__ import annotations

from pathlib import Path

import lanes
import pytest
from helpers import REPO, env_with, last_json_line, root_env
from helpers import qeval as run_qeval

pytestmark = pytest.mark.integration  # each test runs `qeval` in a process of its own


def qeval(*args: str, **env: str):
    return run_qeval(*args, env=env_with(**env))


def test_models_lists_the_cards_as_json(workdir):
    proc = qeval("models", "--json", QEVAL_WORKDIR=str(workdir))
    assert proc.returncode == 0, proc.stderr
    doc = last_json_line(proc.stdout)
    assert "ref-lm" in {m["name"] for m in doc["models"]} and doc["invalid"] == []


def test_unknown_model_is_exit_2_with_one_line(workdir):
    proc = qeval("run", "--model", "ref_lm", QEVAL_WORKDIR=str(workdir))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"qeval: error: unknown model 'ref_lm' (did you mean 'ref-lm'?); known: llama-3.1-8b-instruct, "
        f"qwen2.5-0.5b-instruct, ref-lm, ref-lm-formats (add a card as {REPO}/pipelines/models/ref_lm.yaml)"
    ]


def test_bad_card_is_exit_2_with_one_line(workdir, cards):
    path = cards(
        "broken",
        "name: broken\ndescription: x\nsource: {path: refmodel/ref-lm}\nprecisions: [bf16]\n"
        "accuracy: {tasks: [refkjv_ppl]}\nspeed: {slo: {ttft_ms: 1, tpot_ms: 1}, batchsizes: [1]}\n",
    )
    proc = qeval("run", "--model", "broken", QEVAL_WORKDIR=str(workdir), QEVAL_CARDS_DIR=str(path.parent))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "unknown key 'speed.batchsizes'" in lines[0]
    listed = qeval("models", QEVAL_WORKDIR=str(workdir), QEVAL_CARDS_DIR=str(path.parent))
    assert listed.returncode == 2 and "broken.yaml" in listed.stderr


def test_unknown_precision_is_exit_2(workdir):
    proc = qeval("evaluate", "--model", "ref-lm", "--precision", "int4", QEVAL_WORKDIR=str(workdir))
    assert proc.returncode == 2
    assert "unknown precision 'int4'" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def _refusals(folder: Path, env: dict[str, str]) -> dict[str, object]:
    """`qeval` commands refused before any stage, each a process that imports what its stage would: a quantized
    build without its checkpoint; a card naming an unknown task, evaluated and listed. Beside the tests
    (tests/lanes.py)."""
    empty, typo = folder / "empty", folder / "typo"
    empty.mkdir()
    (typo / "cards").mkdir(parents=True)
    text = (REPO / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", "name: typo")
    (typo / "cards/typo.yaml").write_text(text.replace("tasks: [refkjv_ppl,", "tasks: [refkjv_pppl,"))
    return {
        "no checkpoint": run_qeval(
            "evaluate", "--model", "ref-lm", "--precision", "gptq", env=env_with(env, QEVAL_WORKDIR=str(empty))
        ),
        "typo": typo,
        # said when the card is read, not minutes later
        **{
            args[0]: run_qeval(*args, env=root_env(typo, env))
            for args in (("evaluate", "--model", "typo"), ("models",))
        },
    }


refusals = lanes.side_job("refusals", _refusals)


def test_quantized_build_without_checkpoint_says_how_to_build_it(refusals):
    proc = refusals["no checkpoint"]
    assert proc.returncode == 2
    assert "ref-lm@gptq has no quantized checkpoint" in proc.stderr


def test_unwritable_store_is_exit_2(workdir):
    blocker = workdir / "plain-file"
    blocker.write_text("")
    proc = qeval(
        "run",
        "--model",
        "ref-lm",
        QEVAL_WORKDIR=str(workdir),
        MLFLOW_TRACKING_URI=f"sqlite:///{blocker}/mlflow.db",
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not usable" in lines[0] and "MLFLOW_TRACKING_URI" in lines[0]
    assert not (workdir / "artifacts" / "ref-lm" / "bf16" / "evaluate").exists()


def test_precision_not_in_the_card_is_exit_2(workdir, cards):
    path = cards(
        "only-bf16",
        "name: only-bf16\ndescription: x\nsource: {path: refmodel/ref-lm}\n"
        "precisions: [bf16]\naccuracy: {tasks: [refkjv_ppl]}\nspeed: {slo: {ttft_ms: 1, tpot_ms: 1}}\n",
    )
    proc = qeval(
        "evaluate",
        "--model",
        "only-bf16",
        "--precision",
        "fp8",
        QEVAL_WORKDIR=str(workdir),
        QEVAL_CARDS_DIR=str(path.parent),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "qeval: error: model 'only-bf16' does not build 'fp8'; its card lists: bf16"


def test_an_unknown_task_is_refused_before_the_stage_with_a_suggestion(refusals):
    for command in ("evaluate", "models"):
        proc = refusals[command]
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert "model 'typo': accuracy task 'refkjv_pppl' is defined neither in eval/tasks/refkjv nor in" in last
        assert "(did you mean 'refkjv_ppl'?)" in last and "Traceback" not in proc.stderr
    assert not (refusals["typo"] / "artifacts/typo/bf16/evaluate").exists()  # no stage started


def _hub_task_offline(folder: Path, env: dict[str, str]):
    """`qeval evaluate` of a card with one of lm-eval's hub tasks, the hub off: it starts lm-eval, which reads its
    whole task index, so it runs beside the tests (tests/lanes.py)."""
    text = (REPO / "pipelines/models/ref-lm.yaml").read_text().replace("name: ref-lm", "name: hubtask")
    (folder / "cards").mkdir()
    (folder / "cards/hubtask.yaml").write_text(text.replace("tasks: [refkjv_ppl,", "tasks: [arc_easy, refkjv_ppl,"))
    return run_qeval("evaluate", "--model", "hubtask", env=root_env(folder, env))


hub_task_offline = lanes.side_job("hub_task_offline", _hub_task_offline)


@pytest.mark.slow
def test_hub_task_while_offline_says_how_to_supply_it(hub_task_offline):
    proc = hub_task_offline
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "task 'arc_easy' needs its data set from the hub, which is off here" in last
    assert "dataset_path: json" in last


def test_an_unknown_stage_to_skip_is_named_with_a_suggestion(workdir):
    proc = qeval("run", "--model", "ref-lm", "--skip", "serve-bench", QEVAL_WORKDIR=str(workdir))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "qeval: error: --skip: unknown stage 'serve-bench' (did you mean 'serve', 'bench'?); known: quantize, "
        "evaluate, bench, shape, size, serve, sensitivity"
    ]
