"""The formats of Hopper and Blackwell GPUs on ref-lm (card ref-lm-formats, `make formats`), small: each new precision
and the mixed NVFP4 build whose most sensitive layer groups are FP8, built for real and proven layer by layer,
evaluated, benched, sized and gated, and the mix served; how each runs on this CPU as transformers reports it and
as the kernel table says vLLM would (slow). One side job (tests/lanes.py) runs it all as `qeval` commands."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lanes
import pytest
from helpers import REPO, root_env
from helpers import qeval as run_qeval
from safetensors import safe_open

from conftest import SMALL, use_root
from pipelines.core.card.cards import ModelCard, load_card
from pipelines.core.store.manifests import result_of
from pipelines.core.store.results import Benched, Evaluated, Quantized, Ranked, Served, Sized
from pipelines.core.store.verdicts import Decision, read_decision
from pipelines.stages import engines
from quant.execution import CPU, compute_dtype, runs
from quant.precisions import get_precision
from quant.verify import stored_formats

pytestmark = pytest.mark.slow

NEW = ("fp8-block", "w4a8", "nvfp4a16", "nvfp4")
MIX = "nvfp4+2xfp8"
# two tasks, not six: what is checked is that each format goes through every stage, not its verdicts
CUT = ("refkjv_last_word: 0.98", "refkjv_continue: 0.8", "refkjv_needle: 0.8", "refkjv_continue: chrf")
TASKS = (
    "tasks: [refkjv_ppl, refkjv_next_verse, refkjv_last_word, refkjv_continue, refkjv_needle, refkjv_needle_control]"
)


def formats_small_text() -> str:
    """ref-lm-formats' card as `formats-small`: ref-small's grid (tests/conftest.py, SMALL), two tasks, the mix."""
    text = (
        (REPO / "pipelines/models/ref-lm-formats.yaml")
        .read_text()
        .replace("name: ref-lm-formats", "name: formats-small")
    )
    for a, b in SMALL.items():
        assert a in text, f"ref-lm-formats.yaml no longer has {a!r}"
        text = text.replace(a, b)
    for line in (*CUT, "refkjv_needle: refkjv_needle_control"):
        assert f"    {line}\n" in text, line
        text = text.replace(f"    {line}\n", "")
    listed = "precisions: [bf16, fp8, fp8-block, w4a8, nvfp4a16, nvfp4]"
    assert TASKS in text and listed in text
    text = text.replace(TASKS, "tasks: [refkjv_ppl, refkjv_next_verse]").replace(listed, listed[:-1] + f", {MIX}]")
    assert "  served_accuracy: true\n" in text  # a sweep is what is checked of the mix's server, not its scoring
    text = text.replace("  served_accuracy: true\n", "  served_accuracy: false\n")
    return text.replace("  task_metric:\n", "").replace("  controls:\n", "")


def _formats(folder: Path, env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """Every build of `formats-small` through quantize (the mix after nvfp4's ranking), evaluate, bench and size,
    then the gate, each a `qeval` command as a user runs it: the folder, and each command's stderr where it
    failed."""
    (folder / "cards").mkdir()
    (folder / "cards" / "formats-small.yaml").write_text(formats_small_text())
    env = root_env(folder, env)
    failed = {}
    for args in (
        ("sensitivity", "--precision", "nvfp4"),  # which groups the mix keeps at FP8
        ("quantize",),
        ("stage", "evaluate"),  # every build (`qeval evaluate` takes one)
        ("bench",),
        ("stage", "size"),
        ("gate",),
        ("serve", "--precision", MIX),  # no kernel of vLLM's runs it here: transformers serve, emulated
    ):
        done = run_qeval(*args, "--model", "formats-small", env=env, timeout=600)
        if done.returncode not in (0, 1):  # the gate's 1: nothing ships
            failed[args[0]] = done.stderr[-2000:]
    return folder, failed


formats_run = lanes.side_job("formats_run", _formats)


@dataclass(frozen=True)
class Formats:
    card: ModelCard
    ranked: Ranked  # nvfp4's layer groups, most sensitive first
    built: dict[str, Quantized]
    done: dict[str, dict]  # stage -> precision -> result
    decision: Decision


@pytest.fixture
def formats(formats_run, monkeypatch) -> Formats:
    """What the side job left, read back through the stages' own readers."""
    folder, failed = formats_run
    assert failed == {}, failed
    use_root(monkeypatch, folder)
    card = load_card("formats-small")
    kinds = {"evaluate": Evaluated, "bench": Benched, "size": Sized, "serve": Served}
    done = {stage: {p: result_of(card.name, p, kind) for p in card.precisions} for stage, kind in kinds.items()}
    built = {p: result_of(card.name, p, Quantized) for p in card.precisions}
    return Formats(card, result_of(card.name, "nvfp4", Ranked), built, done, read_decision(card.name))


def _linear_layers() -> list[str]:
    """ref-lm's linear layers but the output head, by the names of their weights."""
    with safe_open(str(REPO / "refmodel/ref-lm/model.safetensors"), "pt") as f:
        return sorted(n.removesuffix(".weight") for n in f.keys() if n.endswith("_proj.weight"))  # noqa: SIM118


def test_each_new_format_is_built_and_proven_layer_by_layer(formats):
    ranked, built = formats.ranked, formats.built
    layers = _linear_layers()
    assert len(layers) == 42
    for p in (*NEW, MIX):
        q, want = built[p], get_precision(p)
        assert q.proof.format == want.checkpoint_format and q.proof.weight_bits == want.weight_bits, p
        assert q.proof.kl_vs_baseline > 0 and q.proof.top1_agreement >= 0.5, p
        stored = stored_formats(Path(q.checkpoint), layers)
        if p == MIX:
            kept = set(ranked.modules(2)[1])
            assert q.proof.layers == {"nvfp4-pack-quantized": 42 - len(kept), "float-quantized": len(kept)}
            assert {m for m, f in stored.items() if f == "float-quantized"} == kept and len(kept) > 0
        else:
            assert set(stored.values()) == {want.checkpoint_format}, (p, set(stored.values()))
    # bytes as stored: NVFP4's 4 bits and an FP8 scale per 16, W4A8's 4 bits and a 16-bit scale per 128, FP8's 8
    weights = {p: built[p].checkpoint_bytes for p in (*NEW, "fp8")}
    assert weights["w4a8"] < weights["nvfp4a16"] < weights["fp8-block"] <= weights["fp8"] * 1.01
    assert built["nvfp4"].config.group_size == 16 and built["w4a8"].config.group_size == 128


def test_each_new_format_is_evaluated_benched_sized_and_gated(formats):
    done = formats.done
    judged = {b.precision: b for b in formats.decision.builds}
    assert set(judged) == set(formats.card.precisions) - {"bf16"}
    for p in (*NEW, MIX):
        assert done["evaluate"][p].accuracy.n_samples == {"refkjv_ppl": 6, "refkjv_next_verse": 6}, p
        engine = done["bench"][p].engine
        # transformers dequantizes every format: what its engine says it ran, and the gate's label
        assert engine.execution == "emulated", (p, engine.kernels)
        # lm-eval computed each as this CPU computes the baseline (float32 without bf16 units), NVFP4 too
        assert done["evaluate"][p].config.dtype == compute_dtype(CPU), p
        assert judged[p].speed.execution == "emulated" and set(judged[p].tasks) == {"refkjv_ppl", "refkjv_next_verse"}
    fits = {p: {f.gpu: f for f in done["size"][p].fits} for p in (*NEW, MIX)}
    assert {p: fits[p]["b200"].execution for p in (*NEW, MIX)} == {
        "fp8-block": "native",
        "w4a8": "no-kernel",
        "nvfp4a16": "weight-only",
        "nvfp4": "native",
        MIX: "native",
    }
    assert fits["w4a8"]["b200"].why_not and fits["w4a8"]["h100-sxm"].execution == "native"
    assert fits["nvfp4"]["h100-sxm"].execution == "weight-only" and fits["fp8-block"]["l4"].execution == "weight-only"


def test_vllms_cpu_build_is_handed_only_what_a_kernel_of_its_runs(formats):
    """The serve and shape stages ask engines.vllm_cannot_run before starting vLLM: on this CPU no NVFP4 or W4A8
    build (nor the mix) reaches it, and block FP8 only where AMX runs it; the others are served by transformers
    serve, labelled emulated, as the mix was."""
    dtype = engines.vllm_dtype(CPU)
    for p in formats.card.precisions:
        row = runs(p, CPU)
        cannot = engines.vllm_cannot_run(p, CPU, dtype=dtype)
        if row is not None and not row.runs:
            assert cannot == row.why, p
    for p in ("w4a8", "nvfp4a16", "nvfp4", MIX):
        assert engines.vllm_cannot_run(p, CPU, dtype=dtype), p
    served = formats.done["serve"][MIX]  # the mix's server: the serve stage's own choice, as it said
    assert served.engine == "transformers" and served.execution == "emulated" and served.per_level, served.engine
