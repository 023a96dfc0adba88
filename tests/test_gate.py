"""The gate's policy as pure functions, then applied for real to the small builds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import accuracy_result, env_with, last_json_line, qeval, root_env, same_logits

from eval.quality.paired import Scored, generation, paired
from eval.quality.records import GENERATED_IDS, Metric, leaves
from eval.quality.stats import Verdict, compare
from eval.quality.stopping import StopScoring, TaskRule, first_stop
from pipelines.core.card.cards import Gate
from pipelines.core.store.formats import precision_colour
from pipelines.core.store.verdicts import BuildVerdict, Decision, Measured
from pipelines.decision.policy import choose, combine, length_rule, memory_rule, speed_rule, task_rule
from pipelines.present.charts import pareto
from pipelines.present.report_tables import documents_section
from pipelines.tracking.store import sqlite_store
from quant.execution import Execution
from quant.precisions import get_precision

PASS, FAIL, INCONCLUSIVE, NOT_GATED = Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE, Verdict.NOT_GATED
NATIVE, EMULATED = Execution.NATIVE, Execution.EMULATED


def _build(name: str, verdict: str, tps: float, weights: float) -> BuildVerdict:
    speed = Measured(tps, weights + 1, weights, NATIVE)
    return BuildVerdict(precision=name, verdict=verdict, rules=[], tasks={}, speed=speed, speedup=None)


def test_a_build_passes_only_when_every_rule_passes():
    assert combine([PASS, PASS, NOT_GATED]) == PASS
    assert combine([PASS, INCONCLUSIVE, NOT_GATED]) == INCONCLUSIVE
    assert combine([INCONCLUSIVE, FAIL, PASS]) == FAIL


def test_choose_fastest_with_ties_to_smaller_weights():
    builds = [
        _build("fp8", PASS, 100, 8.0),
        _build("awq", PASS, 98, 5.0),  # within 3 % of the fastest, and smaller: ships
        _build("int8", PASS, 90, 8.0),
        _build("gptq", FAIL, 200, 4.0),  # fastest and smallest, but failed
    ]
    chosen, why = choose(builds, "speed", 0.03)
    assert chosen == "awq" and "within 3%" in why and "fp8" in why
    assert choose(builds, "speed", 0.0)[0] == "fp8"
    assert choose(builds, "memory", 0.03)[0] == "awq"
    assert choose([_build("a", PASS, 90, 5.0), _build("b", PASS, 99, 5.1)], "memory", 0.03)[0] == "b"
    assert choose([_build("a", INCONCLUSIVE, 90, 5.0), _build("b", FAIL, 99, 5.1)], "speed", 0.03)[0] is None


def test_the_worst_task_is_the_one_that_decides_against_its_own_threshold():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2, 400).astype(float)
    lower = base.copy()
    lower[np.flatnonzero(base)[:20]] = 0  # about 10 % fewer right: recovers about 0.9, passes at 0.8
    held = base.copy()
    held[np.flatnonzero(base)[:2]] = 0  # about 1 % fewer: straddles 0.99
    tasks = {
        "needle": compare("acc", list(base), list(lower), higher_is_better=True, threshold=0.8),
        "verse": compare("acc", list(base), list(held), higher_is_better=True, threshold=0.99),
        "same": compare("acc", list(base), list(base), higher_is_better=True, threshold=0.99),
    }
    assert tasks["needle"].verdict == PASS and tasks["verse"].verdict == INCONCLUSIVE
    assert tasks["needle"].recovery[0] < tasks["verse"].recovery[0]  # the lowest recovery is not what decides
    build = BuildVerdict(
        precision="x", verdict=INCONCLUSIVE, rules=[], tasks=tasks, speed=Measured(1, 1, 1, NATIVE), speedup=None
    )
    assert build.worst_task()[0] == "verse"
    passing = build.model_copy(update={"tasks": {k: tasks[k] for k in ("needle", "same")}})
    assert passing.worst_task()[0] == "needle"  # both pass: the one that used more of what its threshold allows


def test_the_report_says_how_many_documents_each_verdict_needs():
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2, 400).astype(float)
    held = base.copy()
    held[np.flatnonzero(base)[:2]] = 0  # about 1 % fewer right: straddles 0.99
    far = base.copy()
    far[np.flatnonzero(base)[:60]] = 0  # about 30 % fewer: fails at 0.99 with room
    tasks = {
        "verse": compare("acc", list(base), list(held), higher_is_better=True, threshold=0.99),
        "word": compare("acc", list(base), list(far), higher_is_better=True, threshold=0.99),
    }
    assert tasks["verse"].verdict == INCONCLUSIVE and tasks["word"].verdict == FAIL
    assert tasks["verse"].n_to_decide > 400 > tasks["word"].n_to_decide  # undecided needs more; decided fewer
    build = BuildVerdict(
        precision="x", verdict=FAIL, rules=[], tasks=tasks, speed=Measured(1, 1, 1, NATIVE), speedup=None
    )
    lines = documents_section(Decision.model_construct(builds=[build]))
    rows = {line.split(" | ")[1]: line for line in lines if line.startswith("| x |")}
    assert rows["word"].startswith(f"| x | word | FAIL | 400 | {tasks['word'].n_to_decide:,} | ")
    need = tasks["verse"].n_to_decide
    kind = "near miss" if need <= 4 * 400 else "out of reach"
    assert rows["verse"].endswith(f"| {kind}: {need / 400:.1f}x the documents |")


def test_speed_rule():
    base = Measured(100.0, 2.0, 16.0, NATIVE)
    fast = Measured(150.0, 1.2, 8.0, NATIVE)
    rule, up = speed_rule(Gate(min_speedup=1.2), fast, base, byte_ratio=2.0)
    assert rule.verdict == PASS and up == pytest.approx(1.5)
    assert speed_rule(Gate(min_speedup=1.6), fast, base, 2.0)[0].verdict == FAIL
    suspect = speed_rule(Gate(min_speedup=1.2), Measured(300.0, 1.2, 8.0, NATIVE), base, byte_ratio=2.0)[0]
    assert suspect.verdict == INCONCLUSIVE and "suspect" in suspect.reason  # 3x from half the bytes
    slow = Measured(40.0, 1.2, 8.0, EMULATED)
    rule = speed_rule(Gate(min_speedup=None), slow, base, 2.0)[0]
    assert rule.verdict == NOT_GATED and "0.40x" in rule.reason and "emulated" in rule.reason


def test_speed_rule_wants_one_harness():
    compiled = "transformers generate, static cache, decode compiled"
    base = Measured(100.0, 2.0, 16.0, NATIVE, engine=compiled)
    eager = Measured(150.0, 1.2, 8.0, NATIVE, engine="transformers generate, static cache, eager")
    rule = speed_rule(Gate(min_speedup=1.2), eager, base, 2.0)[0]
    assert rule.verdict == INCONCLUSIVE and "not the same harness" in rule.reason
    assert speed_rule(Gate(min_speedup=None), eager, base, 2.0)[0].verdict == NOT_GATED
    alike = Measured(150.0, 1.2, 8.0, NATIVE, engine=compiled)
    assert speed_rule(Gate(min_speedup=1.2), alike, base, 2.0)[0].verdict == PASS


def test_speed_rule_in_the_server_regime_uses_goodput():
    policy = Gate(speed_regime="server", min_speedup=1.1)
    base = Measured(100.0, 2.0, 16.0, NATIVE, "server", goodput=4.0, users_at_slo=8)
    build = Measured(90.0, 1.2, 8.0, NATIVE, "server", goodput=5.0, users_at_slo=16)
    rule, up = speed_rule(policy, build, base, byte_ratio=2.0)
    assert rule.verdict == PASS and up == pytest.approx(1.25) and "16 vs 8 users" in rule.reason
    none = Measured(100.0, 2.0, 16.0, NATIVE, "server", goodput=0.0, users_at_slo=0)
    assert speed_rule(policy, build, none, 2.0)[0].verdict == INCONCLUSIVE  # nothing to compare with


def test_fit_rule_names_the_gpus_a_build_does_not_fit():
    from eval.devices.gpus import get_gpu
    from eval.devices.sizing import Shape, fit
    from pipelines.decision.policy import fit_rule

    llama8b = Shape(
        layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False
    )
    grid = {"batch": 32, "input_len": 2048, "output_len": 128, "group_size": 128}
    bf16 = fit_rule([fit(llama8b, "bf16", get_gpu(g), **grid) for g in ("h100-sxm", "l4")])
    assert bf16.verdict == FAIL and "does not fit l4" in bf16.reason
    awq = fit_rule([fit(llama8b, "awq", get_gpu(g), **grid) for g in ("h100-sxm", "l4")])
    assert awq.verdict == PASS and "l4" in awq.reason


def test_memory_rule():
    m = Measured(100.0, 1.5, 1.0, NATIVE)
    assert memory_rule(Gate(memory_budget_gb=2), m).verdict == PASS
    assert memory_rule(Gate(memory_budget_gb=1), m).verdict == FAIL
    assert memory_rule(Gate(), m).verdict == NOT_GATED


def test_task_thresholds_and_reasons():
    policy = Gate(min_recovery=0.98, task_min_recovery={"gsm8k": 0.95}, max_ppl_increase=0.02)
    assert policy.threshold("gsm8k").rule(likelihood=False) == ("recovery", 0.95)
    assert policy.threshold("gsm8k").rule(likelihood=True) == ("recovery", 0.95)  # its own bound wins
    assert policy.threshold("arc").rule(likelihood=False) == ("recovery", 0.98)
    assert policy.threshold("wikitext").rule(likelihood=True) == ("ppl_increase", 0.02)
    assert Gate().threshold("wikitext").rule(likelihood=True) == ("recovery", 0.99)
    unsure = compare("acc", [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0], higher_is_better=True, threshold=0.98)
    reason = task_rule("arc", unsure).reason
    assert reason.startswith("arc: acc recovery 1.0000 [") and "documents would decide" in reason


def test_length_rule_fails_a_build_whose_outputs_ramble(tmp_path):
    """A constructed case through the gate's reading path: per-document records with generated token ids,
    a build whose every output is 40 % longer than the baseline's."""
    scores = {"gen": [Metric(name="chrf", value=0.5)]}
    result = accuracy_result(scores)
    sides = {}
    for side, extra in (("base", 0), ("long", 4)):
        folder = tmp_path / side
        folder.mkdir()
        rows = [{"doc_id": d, "filter": "none", "chrf": 0.5, GENERATED_IDS: list(range(10 + extra))} for d in range(40)]
        if side == "long":
            rows[0][GENERATED_IDS][3] = -1  # departs at token 3 there, at 10 (where the baseline stops) elsewhere
        (folder / "samples_gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        sides[side] = Scored(folder, result)
    g = generation("gen", sides["base"], sides["long"], band=0.10, bootstrap=Gate().bootstrap)
    assert g.length.ratio == (pytest.approx(1.4), pytest.approx(1.4), pytest.approx(1.4))
    rule = length_rule(Gate(), "gen", g.length)
    assert rule.verdict == FAIL and rule.name == "gen length"
    assert "output length 1.400x the baseline's [1.400, 1.400] (14 vs 10 tokens per document)" in rule.reason
    assert sorted(g.departures.positions) == [3] + [10] * 39 and g.departures.identical == 0
    assert length_rule(Gate(max_length_change=None), "gen", g.length).verdict == NOT_GATED
    assert generation("gen", sides["base"], sides["base"], band=0.1, bootstrap=Gate().bootstrap).length.verdict == PASS
    (tmp_path / "base" / "samples_ll.jsonl").write_text(json.dumps({"doc_id": 0, "acc": 1.0}) + "\n")
    assert generation("ll", sides["base"], sides["base"], band=0.1, bootstrap=Gate().bootstrap) is None


def test_a_task_with_a_control_is_judged_by_its_gain_over_it(tmp_path):
    """Per document, the probe's log-likelihood less its control's on the same item: a build that keeps the
    control's score but loses most of what the probe adds fails, though its raw score moved by about 1 %."""
    scores = {t: [Metric(name="bits_per_byte", value=1.0, higher_is_better=False)] for t in ("probe", "ctl")}
    result = accuracy_result(scores)
    rng = np.random.default_rng(1)
    control = -70 + rng.normal(0, 5, 100)
    gain = 0.8 + rng.normal(0, 0.3, 100)
    sides = {}
    for side, kept in (("base", 1.0), ("lossy", 0.2)):
        (folder := tmp_path / side).mkdir()
        for task, ll in (("ctl", control), ("probe", control + kept * gain)):
            rows = [{"doc_id": d, "bits_per_byte": [float(v), 60]} for d, v in enumerate(ll)]
            (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        sides[side] = Scored(folder, result)
    raw = paired(
        "probe", sides["base"], sides["lossy"], threshold=Gate().threshold("probe"), bootstrap=Gate().bootstrap
    )
    assert raw.recovery[0] > 0.98  # the raw score hardly moves
    c = paired(
        "probe",
        sides["base"],
        sides["lossy"],
        threshold=Gate().threshold("probe"),
        bootstrap=Gate().bootstrap,
        control="ctl",
    )
    assert c.metric == "log-likelihood gain over ctl" and c.verdict == FAIL
    assert c.recovery[0] == pytest.approx(0.2) and c.n == 100
    same = paired(
        "probe",
        sides["base"],
        sides["base"],
        threshold=Gate().threshold("probe"),
        bootstrap=Gate().bootstrap,
        control="ctl",
    )
    assert same.recovery[0] == 1.0 and 0.99 <= same.recovery[1] < 1 < same.recovery[2] and same.verdict == PASS
    (tmp_path / "base" / "samples_ctl.jsonl").write_text(json.dumps({"doc_id": 0, "bits_per_byte": [1.0, 1]}) + "\n")
    with pytest.raises(KeyError):  # the control is not the same items
        paired(
            "probe",
            sides["base"],
            sides["lossy"],
            threshold=Gate().threshold("probe"),
            bootstrap=Gate().bootstrap,
            control="ctl",
        )


def test_group_tasks_pool_their_subtasks():
    groups = {"mmlu": ["mmlu_stem", "mmlu_other"], "mmlu_stem": ["mmlu_physics", "mmlu_math"]}
    assert leaves("mmlu", groups) == ["mmlu_physics", "mmlu_math", "mmlu_other"]
    assert leaves("arc_easy", groups) == ["arc_easy"]


def test_pareto_frontier():
    pts = [("bf16", 100, 1.0), ("fp8", 180, 0.995), ("int8", 170, 0.99), ("awq", 250, 0.97)]
    assert pareto(pts) == ["bf16", "fp8", "awq"]


# ---- for real, on the small builds ---------------------------------------------------------------


def _gate_cli(root, *args: str):
    return qeval(*args, env=root_env(root))


def _with_policy(root, **policy) -> None:
    """Rewrite the small card's gate section (the same card name keeps the same artifacts)."""
    path = root / "cards" / "ref-small.yaml"
    text = path.read_text()
    head = text[: text.index("gate:")]
    path.write_text(head + "gate:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in policy.items()))


@dataclass
class Shipped:
    root: Path
    decision: dict
    client: object
    version: object

    def build(self, precision: str) -> dict:
        return next(b for b in self.decision["builds"] if b["precision"] == precision)


@pytest.fixture(scope="module")
def shipped(small_root, builds, measured, tmp_path_factory):
    """ref-small gated once for the tests below, under a lenient policy that every quantized build of the same
    model passes on a handful of documents. They read it in file order; the last one changes the policy."""
    from mlflow.tracking import MlflowClient

    from conftest import copy_root, use_root
    from pipelines.core.card.cards import load_card
    from pipelines.stages.evaluate import evaluate
    from pipelines.tracking.mlflow_tracker import MlflowTracker

    with pytest.MonkeyPatch.context() as mp:  # for the set-up alone: the tests name the root they read
        root = copy_root(small_root, tmp_path_factory.mktemp("shipped") / "own")
        use_root(mp, root)
        # the session's builds were evaluated without a store: their (unchanged) evaluations go to this one's
        # runs, as `qeval run` logs them, for the regression gate to read back
        card, tracker = load_card("ref-small"), MlflowTracker("ref-small")
        assert {evaluate(card, p, tracker).status for p in card.precisions} == {"skipped"}
        # judged once by the bootstrap: a confidence sequence decides nothing on six documents (docs/gate.md)
        lenient = {"min_recovery": 0.5, "max_length_change": None, "min_speedup": None, "bootstrap_seed": 7}
        lenient["verdicts"] = "bootstrap"
        _with_policy(root, baseline="bf16", prefer="memory", **lenient)
        done = _gate_cli(root, "gate", "--model", "ref-small", "--json")
        assert done.returncode == 0, done.stderr[-2000:]
    client = MlflowClient(sqlite_store(root / "mlruns"))
    version = client.get_model_version_by_alias("qeval-ref-small", "ship")
    return Shipped(root, last_json_line(done.stdout)["gate"], client, version)


@pytest.mark.slow
def test_the_gate_ships_the_smallest_build_that_passes(shipped):
    decision = shipped.decision
    verdicts = {b["precision"]: b["verdict"] for b in decision["builds"]}
    assert set(verdicts) == {"fp8", "int8", "awq", "gptq", "int8+kv-fp8"}
    assert decision["chosen"] in {p for p, v in verdicts.items() if v == PASS}
    assert decision["chosen"] in {"awq", "gptq"}  # 4-bit builds are the smallest
    # the weights the policy ranks are the builds' weight files, not the bench's dequantized copies in memory
    weights = {b["precision"]: b["speed"]["weights_gb"] for b in decision["builds"]}
    sized = shipped.root / "artifacts/ref-small/{}/size/manifest.json"
    files = {p: json.loads(Path(str(sized).format(p)).read_text())["result"]["weights_bytes"] for p in weights}
    assert weights == {p: b / 1e9 for p, b in files.items()}
    smallest = min(w for p, w in weights.items() if verdicts[p] == PASS)  # builds within the tie tolerance tie
    assert smallest <= weights[decision["chosen"]] <= smallest * (1 + decision["policy"]["tie_tolerance"])
    assert weights[decision["chosen"]] < weights["int8"] == weights["int8+kv-fp8"]  # it shares int8's files
    assert decision["policy"]["bootstrap_seed"] == 7 and decision["policy"]["bootstrap_resamples"] == 2000
    assert decision["code"]["commit"]
    on_disk = json.loads((shipped.root / "artifacts/ref-small/gate.json").read_text())
    assert on_disk["chosen"] == decision["chosen"] and on_disk["decided"] == decision["decided"]


@pytest.mark.slow
def test_the_shipped_build_is_registered_and_described_in_the_runs_table(shipped):
    chosen, client = shipped.decision["chosen"], shipped.client
    run = client.get_run(shipped.version.run_id)
    assert run.data.tags["qeval.precision"] == chosen
    assert run.data.tags["qeval.gate.verdict"] == PASS
    assert "refkjv_ppl: bits_per_byte recovery" in run.data.tags["qeval.gate.reasons"]
    # what the runs table shows without set-up: the precision, its colour, and a description with the verdict
    assert run.data.params["precision"] == chosen
    assert run.data.tags["mlflow.runColor"] == precision_colour(chosen)
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith("PASS, SHIPS: ") and " · recovery " in note
    assert note.endswith(tuple(f"({e})" for e in Execution))
    weights = shipped.build(chosen)["speed"]["weights_gb"]
    assert run.data.metrics["gate/weights_gb"] == pytest.approx(weights, rel=1e-3)  # four digits
    flipped = shipped.build(chosen)["flips"]["refkjv_last_word"]  # answers that changed, logged with the verdict
    assert run.data.metrics["gate/refkjv_last_word/flip_rate"] == pytest.approx(flipped["rate"][0], rel=1e-3, abs=1e-9)
    assert (
        run.data.metrics["gate/refkjv_last_word/flip_rate_upper"] >= run.data.metrics["gate/refkjv_last_word/flip_rate"]
    )
    view = json.loads(client.get_experiment(run.info.experiment_id).tags["mlflow.sharedViewState.qeval"])
    assert view["selectedColumns"][0] == "attributes.`Description`"
    # the registered version's source is the checkpoint logged on the build's run
    assert shipped.version.source == f"{run.info.artifact_uri}/quantize/checkpoint"


@pytest.mark.slow
def test_the_ship_card_read_back_from_the_store_says_what_the_gate_decided(shipped):
    """The ship card's Markdown, rendered once here: its sections, every task's interval, every rule."""
    chosen = shipped.build(shipped.decision["chosen"])
    card_text = _gate_cli(shipped.root, "card", "--model", "ref-small")
    assert card_text.returncode == 0, card_text.stderr[-2000:]
    shown = card_text.stdout
    assert shown.startswith(f"# ref-small {chosen['precision']}: the build qeval ships")
    for task, c in chosen["tasks"].items():
        rec, lo, hi = c["recovery"]
        assert f"| {task} | {c['metric']} |" in shown and f"| {rec:.4f} | [{lo:.4f}, {hi:.4f}] |" in shown
    for section in ("## What it is", "## Accuracy against the baseline", "## Speed, as measured", "## Serving it"):
        assert section in shown, section
    assert all(f"- {r['reason']}" in shown for r in chosen["rules"])


@pytest.mark.slow
def test_a_pulled_build_is_the_gated_one_and_a_changed_store_is_refused(shipped):
    """Any machine reaching the store pulls the shipped build into an empty folder, and it is the gated build
    (same logits); a copy in the store changed after the gate is refused, naming the file."""
    root, chosen = shipped.root, shipped.decision["chosen"]
    pulled = root / "elsewhere" / "ship"
    got = _gate_cli(root, "pull", "--model", "ref-small", str(pulled), "--json")
    assert got.returncode == 0, got.stderr[-2000:]
    assert last_json_line(got.stdout)["precision"] == chosen
    built = get_precision(chosen).shares or chosen  # a KV-cache variant ships its precision's checkpoint
    assert same_logits(pulled, root / "artifacts/ref-small" / built / "quantize/checkpoint")
    again = _gate_cli(root, "pull", "--model", "ref-small", str(pulled))
    assert again.returncode == 2 and "not an empty folder" in again.stderr
    checked = _gate_cli(root, "verify", "--model", "ref-small", str(pulled))
    assert checked.returncode == 0 and " files of version " in checked.stdout, checked.stderr[-2000:]
    stored = Path(shipped.version.source.removeprefix("file://")) / "model.safetensors"
    original = stored.read_bytes()
    try:
        stored.write_bytes(original[:-1] + b"\0")
        changed = _gate_cli(root, "pull", "--model", "ref-small", str(root / "elsewhere" / "changed"))
        assert changed.returncode == 2 and "model.safetensors has changed" in changed.stderr.strip().splitlines()[-1]
        assert not (root / "elsewhere" / "changed").exists()
    finally:
        stored.write_bytes(original)


@pytest.mark.slow
def test_a_regression_gate_judges_every_build_against_what_ships_and_the_report_draws_it(shipped):
    root, version, chosen = shipped.root, shipped.version, shipped.decision["chosen"]
    against = _gate_cli(root, "gate", "--model", "ref-small", "--against", "ship", "--json")
    assert against.returncode == 0, against.stderr[-2000:]
    regated = last_json_line(against.stdout)["gate"]
    assert regated["against"]["version"] == str(version.version)
    assert regated["against"]["precision"] == chosen
    for b in regated["builds"]:
        assert set(b["vs_ship"]) == set(shipped.build(b["precision"])["tasks"])
        assert any(r["name"] == f"refkjv_ppl vs ship v{version.version} ({chosen})" for r in b["rules"])
    itself = next(b for b in regated["builds"] if b["precision"] == chosen)
    assert all(c["recovery"] == [1.0, 1.0, 1.0] for c in itself["vs_ship"].values())  # the same documents, scores
    # the report draws the decision the gate made, not one of its own
    shown = _gate_cli(root, "report", "--model", "ref-small")
    assert shown.returncode == 0, shown.stderr[-2000:]
    md = (root / "reports/ref-small/report.md").read_text()
    assert f"**Decision:** {regated['chosen']} " in md and regated["decided"] in md  # the last one


@pytest.mark.slow
def test_nothing_passes_a_regression_gate_keeps_ship_and_a_plain_gate_withdraws_it(shipped):
    """A strict speed rule no emulated build can meet (this test changes the module's policy: it runs last)."""
    root, client = shipped.root, shipped.client
    _with_policy(root, baseline="bf16", min_recovery=0.5, min_speedup=50)
    strict_against = _gate_cli(root, "gate", "--model", "ref-small", "--against", "ship")
    assert strict_against.returncode == 1 and "nothing replaces ship v" in strict_against.stderr
    assert client.get_model_version_by_alias("qeval-ref-small", "ship").version == shipped.version.version
    strict = _gate_cli(root, "gate", "--model", "ref-small", "--json")
    assert strict.returncode == 1, strict.stderr[-2000:]
    assert "nothing ships" in strict.stderr
    builds = last_json_line(strict.stdout)["gate"]["builds"]
    assert PASS not in {b["verdict"] for b in builds}
    # each build fails the speed rule, or its speed-up is beyond what its bytes allow (suspect, INCONCLUSIVE);
    # the KV-cache variant's bench emulates its cache, which is not the baseline's harness (INCONCLUSIVE)
    said = ("vs min 50x", "suspect", "FP8 KV cache emulated vs the baseline's")
    assert all(any(any(s in r["reason"] for s in said) for r in b["rules"]) for b in builds)
    assert json.loads((root / "artifacts/ref-small/gate.json").read_text())["chosen"] is None
    with pytest.raises(Exception, match="ship"):
        client.get_model_version_by_alias("qeval-ref-small", "ship")


@pytest.mark.slow
def test_a_fit_rule_reads_the_size_stage(own_root):
    from memory_tracker import MemoryTracker

    from pipelines.core.card.cards import load_card
    from pipelines.core.system.errors import QevalError
    from pipelines.decision.gate import decide
    from pipelines.stages.size import size

    _with_policy(own_root, min_recovery=0.5, min_speedup=None, must_fit=["a10g"])
    card = load_card("ref-small")
    # the session's builds were sized for the card's target GPUs, not for the one the policy now names
    refused = r"was sized for other GPUs or another grid; rerun: qeval size --log --model ref-small"
    with pytest.raises(QevalError, match=refused):
        decide(card)
    for p in card.precisions:
        size(card, p, MemoryTracker(card.name))
    decision = decide(card)
    fit = [r for b in decision.builds for r in b.rules if r.name == "fit"]
    assert len(fit) == 5 and all(r.verdict == PASS and "a10g" in r.reason for r in fit)


@pytest.mark.integration
def test_gate_without_measurements_is_a_one_line_error(tmp_path):
    done = qeval("gate", "--model", "ref-lm", env=env_with(QEVAL_WORKDIR=str(tmp_path)), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "no finished bench stage" in done.stderr and "qeval bench --model ref-lm" in done.stderr


@pytest.mark.integration
def test_report_without_a_decision_says_to_run_the_gate(tmp_path):
    done = qeval("report", "--model", "ref-lm", env=env_with(QEVAL_WORKDIR=str(tmp_path)), timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "no gate decision" in done.stderr and "qeval gate --model ref-lm" in done.stderr


def test_scoring_stops_at_the_first_task_a_build_cannot_ship_with(tmp_path):
    """eval/stopping.first_stop on constructed records: a task is judged once it (and its control) is scored;
    a FAIL stops; an INCONCLUSIVE stops only under `inconclusive`; a passing task does not."""
    tasks = ("same", "unsure", "lost")
    scores = {t: [Metric(name="acc", value=1.0)] for t in tasks}
    result = accuracy_result(scores)
    # 600 documents: a confidence sequence passes a build that matches every one only after hundreds (with none
    # flipped in 600, a loss of 1 % of 600 right answers is still unlikely enough only then)
    build_acc = {"same": [1.0] * 600, "unsure": [1.0] * 594 + [0.0] * 6, "lost": [0.0] * 600}
    for side in ("base", "build"):
        (tmp_path / side).mkdir()
        for task in tasks:
            values = [1.0] * 600 if side == "base" else build_acc[task]
            rows = "".join(json.dumps({"doc_id": d, "acc": v}) + "\n" for d, v in enumerate(values))
            (tmp_path / side / f"samples_{task}.jsonl").write_text(rows)
    rules = {t: TaskRule(threshold=Gate().threshold(t)) for t in tasks}

    def stop(when: str, scored: tuple[str, ...], rules=rules) -> tuple[str | None, set[str]]:
        rule = StopScoring(
            when=when, rules=rules, bootstrap=Gate().bootstrap, baseline_folder=str(tmp_path / "base"), baseline=result
        )
        partial = result.model_copy(update={"scores": {t: result.scores[t] for t in scored}})
        judged: set[str] = set()
        return first_stop(rule, tmp_path / "build", partial, judged), judged

    assert stop("fail", ("same",)) == (None, {"same"})
    assert stop("fail", ("same", "unsure")) == (None, {"same", "unsure"})
    why, _ = stop("inconclusive", ("same", "unsure"))
    assert why.startswith("unsure INCONCLUSIVE (acc 0.99 [")
    why, judged = stop("fail", tasks)
    assert why.startswith("lost FAIL (acc 0 [0, 0.00") and judged == set(tasks)
    waits = {**rules, "lost": TaskRule(threshold=Gate().threshold("lost"), control="same")}
    assert stop("fail", ("lost",), waits) == (None, set())  # its control is not scored yet


@pytest.mark.slow
def test_a_build_that_fails_a_task_is_not_scored_further(own_root):
    """gate.stop_scoring: fail, for real: the baseline and int8 scored a task at a time, int8's scoring
    stopped at its first task, which a threshold no build can meet fails; the gate, the report's table and
    its policy say what was not scored, and the build cannot pass."""
    from memory_tracker import MemoryTracker

    from pipelines.core.card.cards import load_card
    from pipelines.decision.gate import decide
    from pipelines.present.report_tables import policy_text, table
    from pipelines.stages.evaluate import evaluate

    card_file = own_root / "cards" / "ref-small.yaml"
    card_file.write_text(
        card_file.read_text().replace(
            "precisions: [bf16, fp8, int8, awq, gptq, int8+kv-fp8]", "precisions: [bf16, int8]"
        )
    )
    _with_policy(
        own_root,
        baseline="bf16",
        min_recovery=0.5,
        min_speedup=None,
        stop_scoring="fail",
        task_min_recovery={"refkjv_ppl": 1.5},
    )
    card, tracker = load_card("ref-small"), MemoryTracker("ref-small")
    first, *rest = card.accuracy.tasks
    base = evaluate(card, "bf16", tracker)  # scored again: a task at a time, as the builds that may stop
    assert base.status == "done" and base.result.config.one_at_a_time and base.result.config.stop is None
    assert not base.result.accuracy.not_scored and set(base.result.accuracy.scores) >= set(card.accuracy.tasks)
    done = evaluate(card, "int8", tracker).result
    assert list(done.accuracy.not_scored) == rest
    assert all(why.startswith(f"scoring stopped: {first} FAIL (") for why in done.accuracy.not_scored.values())
    folder = own_root / "artifacts/ref-small/int8/evaluate"
    assert [p.name for p in folder.glob("samples_*.jsonl")] == [f"samples_{first}.jsonl"]

    decision = decide(card)
    (b,) = decision.builds
    assert b.verdict == FAIL and list(b.tasks) == [first] and b.not_scored == done.accuracy.not_scored
    assert {r.name: r.verdict for r in b.rules if r.name in rest} == dict.fromkeys(rest, INCONCLUSIVE)
    assert table(card, decision)[f"{rest[0]} recovery [interval]"] == ["1", "not scored"]
    assert "a quantized build's scoring stopped at its first task that failed" in policy_text(decision)


@pytest.mark.slow
def test_a_gate_of_some_builds_un_ships_only_a_build_it_judged(own_root):
    """With `ship` on fp8, `qeval gate --precision int8` that passes nothing deleted the alias, and `qeval card`
    then said nothing ships (issue 41); gating fp8 itself, failing, still withdraws it."""
    from memory_tracker import MemoryTracker

    from pipelines.core.card.cards import load_card
    from pipelines.decision.gate import gate, nothing_to_gate
    from pipelines.present.shipcard import ship_card

    _with_policy(own_root, baseline="bf16", min_recovery=0.5, min_speedup=None, task_min_recovery={"refkjv_ppl": 1.5})
    card, tracker = load_card("ref-small"), MemoryTracker("ref-small")
    tracker.register_ship(tracker.build_run("fp8"), "fp8's checkpoint", "an earlier gate")
    some = gate(card.model_copy(update={"precisions": ["bf16", "int8"]}), tracker, ship_card=ship_card)
    assert some.chosen is None and [b.precision for b in some.builds] == ["int8"]
    assert tracker.shipped()["precision"] == "fp8"
    assert gate(card.model_copy(update={"precisions": ["bf16", "fp8"]}), tracker, ship_card=ship_card).chosen is None
    assert tracker.shipped() is None
    # a run that judged nothing (its speed half) leaves the alias where a gate put it (issue 67)
    tracker.register_ship(tracker.build_run("fp8"), "fp8's checkpoint", "an earlier gate")
    assert "fp8 still ships, from an earlier gate" in nothing_to_gate(card, tracker, "no weights here")
    assert tracker.shipped()["precision"] == "fp8"
    # the shipped build taken out of the card, and nothing else passing: the alias is not left on it (issue 67)
    path = own_root / "cards" / "ref-small.yaml"
    path.write_text(path.read_text().replace("precisions: [bf16, fp8, ", "precisions: [bf16, "))
    assert "fp8" not in load_card("ref-small").precisions
    assert gate(card.model_copy(update={"precisions": ["bf16", "int8"]}), tracker, ship_card=ship_card).chosen is None
    assert tracker.shipped() is None
