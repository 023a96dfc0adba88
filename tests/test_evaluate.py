"""Real lm-eval runs on the reference model's local tasks, read back and logged to a real MLflow store."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
from helpers import REPO
from memory_tracker import MemoryTracker
from mlflow.tracking import MlflowClient

from eval.quality import accuracy, records
from eval.quality.compare import recovery
from pipelines.core.card.cards import load_card
from pipelines.core.system.errors import QevalError
from pipelines.stages.evaluate import evaluate
from pipelines.tracking.mlflow_tracker import MlflowTracker
from pipelines.tracking.store import tracking_uri

pytestmark = pytest.mark.slow
TASKS = (
    "refkjv_ppl",
    "refkjv_next_verse",
    "refkjv_last_word",
    "refkjv_continue",
    "refkjv_needle",
    "refkjv_needle_control",
)


@pytest.fixture
def evaluated(measured):
    """bf16 and fp8 of ref-small evaluated on 6 documents per task."""
    return {p: measured["evaluate"][p] for p in ("bf16", "fp8")}


def _raw(record) -> dict:
    return json.loads((record.path / "lm_eval_results.json").read_text())


def test_scores_are_lm_evals_own_results(evaluated):
    for record in evaluated.values():
        raw, result = _raw(record), record.result.accuracy
        for task in TASKS:
            reported = {k: v for k, v in raw["results"][task].items() if "," in k and isinstance(v, float)}
            ours = {f"{m.name},{m.filter}": m.value for m in result.scores[task]}
            ours |= {f"{m.name}_stderr,{m.filter}": m.stderr for m in result.scores[task] if m.stderr is not None}
            assert ours == reported
            lines = (record.path / f"samples_{task}.jsonl").read_text().splitlines()
            assert len(lines) == 6 and "doc_id" in json.loads(lines[0])
        assert result.n_samples == dict.fromkeys(TASKS, 6) and record.result.config.limit == 6
    bpb = {m.name: m.value for m in evaluated["bf16"].result.accuracy.scores["refkjv_ppl"]}
    assert math.log2(bpb["byte_perplexity"]) == pytest.approx(bpb["bits_per_byte"], rel=1e-6)
    assert not next(m for m in evaluated["bf16"].result.accuracy.scores["refkjv_ppl"]).higher_is_better


def test_documents_are_read_back_per_metric(evaluated):
    record = evaluated["bf16"]
    folder, result = record.path, record.result.accuracy
    names = {m.name for m in records.document_metrics(folder, result, "refkjv_next_verse")}
    assert {"acc", "acc_norm"} <= names
    acc = next(m for m in result.scores["refkjv_next_verse"] if m.name == "acc")
    docs = records.documents(folder, result, "refkjv_next_verse", acc)
    assert len(docs) == 6 and sum(docs.values()) / 6 == pytest.approx(acc.value)
    bpb = next(m for m in result.scores["refkjv_ppl"] if m.name == "bits_per_byte")
    pairs = records.documents(folder, result, "refkjv_ppl", bpb)  # per chapter: (log-likelihood, bytes)
    total_ll, total_bytes = (sum(v[i] for v in pairs.values()) for i in (0, 1))
    assert -total_ll / total_bytes / math.log(2) == pytest.approx(bpb.value, rel=1e-9)


def test_recovery_is_against_the_baseline_and_inverted_for_perplexity(evaluated):
    base, fp8 = (_raw(evaluated[p])["results"] for p in ("bf16", "fp8"))
    got = evaluated["fp8"].result.recovery
    assert got["refkjv_ppl"]["bits_per_byte"] == pytest.approx(
        base["refkjv_ppl"]["bits_per_byte,none"] / fp8["refkjv_ppl"]["bits_per_byte,none"]
    )
    assert got["refkjv_last_word"]["acc"] == pytest.approx(
        recovery(fp8["refkjv_last_word"]["acc,none"], base["refkjv_last_word"]["acc,none"], True)
    )
    assert evaluated["bf16"].result.recovery is None


def test_logged_to_mlflow_with_task_data_as_run_inputs(own_root):
    card = load_card("ref-small")
    record = evaluate(card, "fp8", MlflowTracker(card.name))  # finished: logged to the fresh store
    assert record.status == "skipped"
    run = MlflowClient(tracking_uri()).get_run(record.run_id)
    assert run.info.run_name == "ref-small@fp8" and run.data.tags["qeval.stage.evaluate"] == "done"
    for task, scores in record.result.accuracy.scores.items():
        for m in scores:
            assert run.data.metrics[f"eval/{task}/{m.id}"] == m.value
    assert run.data.metrics["recovery/refkjv_last_word/acc"] == record.result.recovery["refkjv_last_word"]["acc"]
    assert run.data.params["eval.limit"] == "6" and run.data.params["eval.softmax_dtype"] == "float32"
    inputs = {d.dataset.name: json.loads(d.dataset.source) for d in run.inputs.dataset_inputs}
    assert set(inputs) == set(TASKS)
    data = REPO / "eval/tasks/refkjv/last_word.jsonl"
    assert inputs["refkjv_last_word"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert record.result.accuracy.chance["refkjv_last_word"] == 0.25


def test_a_build_evaluated_unlike_its_baseline_is_refused(small_card, evaluated):
    with pytest.raises(QevalError, match="baseline was evaluated with other settings"):
        evaluate(small_card, "fp8", MemoryTracker(small_card.name), limit=5)


def test_second_evaluation_is_skipped(small_card, evaluated):
    again = evaluate(small_card, "fp8", MemoryTracker(small_card.name), limit=6)
    assert again.status == "skipped" and again.result == evaluated["fp8"].result


def test_a_generative_task_runs_greedily_offline_with_per_document_scores(tmp_path):
    """refkjv_continue through lm-eval's generate_until on ref-lm: every document generated, scored per
    document (exact_match, chrf in 0-1) and recorded with its text, as the paired statistics read them."""
    cfg = accuracy.AccuracyConfig(
        checkpoint=str(REPO / "refmodel/ref-lm"),
        tasks=["refkjv_continue"],
        include_path=str(REPO / "eval/tasks/refkjv"),
        num_fewshot=0,
        limit=8,
        batch_size=8,
        seed=0,
        dtype="float32",
    )
    result = accuracy.evaluate_accuracy(cfg, tmp_path)
    assert result.n_samples == {"refkjv_continue": 8}
    assert {m.name for m in result.scores["refkjv_continue"]} == {"exact_match", "chrf"}
    metric = next(m for m in result.scores["refkjv_continue"] if m.name == "chrf")
    chrf = records.documents(tmp_path, result, "refkjv_continue", metric)
    assert len(chrf) == 8 and all(0.0 <= v <= 1.0 for v in chrf.values())
    assert math.isclose(sum(chrf.values()) / 8, metric.value)
    rows = [json.loads(line) for line in (tmp_path / "samples_refkjv_continue.jsonl").read_text().splitlines()]
    assert all(r["filtered_resps"][0].strip() and "\n" not in r["filtered_resps"][0] for r in rows)  # stops at the line
    # the generated token ids, what output length and departures are counted in: the raw generation's
    ids = records.generated(tmp_path, result, "refkjv_continue")
    assert sorted(ids) == [("refkjv_continue", r["doc_id"]) for r in rows]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "refmodel/ref-lm")
    assert all(tokenizer.decode(ids[("refkjv_continue", r["doc_id"])]) == r["resps"][0][0] for r in rows)
    assert all(len(v) > 0 for v in ids.values())


def test_an_emulated_fp8_kv_cache_moves_long_context_scores_a_little(tmp_path):
    """kv_cache_dtype fp8 rounds every key and value through FP8 before attention reads them: on the needle's
    long contexts ref-lm's per-document log-likelihoods all move, by little (a lost causal mask or a broken
    attention would move them by nats)."""
    cfg = accuracy.AccuracyConfig(
        checkpoint=str(REPO / "refmodel/ref-lm"),
        tasks=["refkjv_needle"],
        include_path=str(REPO / "eval/tasks/refkjv"),
        num_fewshot=0,
        limit=4,
        batch_size=4,
        seed=0,
        dtype="float32",
    )
    got = {}
    for kv in ("auto", "fp8"):
        (tmp_path / kv).mkdir()
        result = accuracy.evaluate_accuracy(cfg.model_copy(update={"kv_cache_dtype": kv}), tmp_path / kv)
        metric = next(m for m in result.scores["refkjv_needle"] if m.name == "bits_per_byte")
        got[kv] = {d: v[0] for d, v in records.documents(tmp_path / kv, result, "refkjv_needle", metric).items()}
    assert got["auto"].keys() == got["fp8"].keys() and len(got["auto"]) == 4
    moved = [abs(got["fp8"][d] - ll) / abs(ll) for d, ll in got["auto"].items()]  # relative to the log-likelihood
    assert all(m > 0 for m in moved) and max(moved) < 0.05
    with pytest.raises(ValueError, match="the server's to keep"):
        accuracy.evaluate_accuracy(
            cfg.model_copy(update={"kv_cache_dtype": "fp8", "backend": "local-completions"}), tmp_path
        )


@pytest.mark.parametrize("kind", ["int", "float"])
def test_number_bounds_fake_quantize_to_the_same_bits(kind):
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import forward
    from compressed_tensors.quantization.utils import calculate_range

    from eval.quality.qdq_fast import clamp_with_number_bounds

    args = QuantizationArgs(num_bits=8, type=kind, strategy="token", symmetric=True, dynamic=True)
    # upstream still hands the range as tensors, the slow clamp this works around: when it stops, drop the patch
    assert all(isinstance(end, torch.Tensor) for end in calculate_range(args, "cpu"))
    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0)) * 3
    # a scale for half of each token's range, so that many values fall outside the quantized range and are clamped
    scale = x.abs().amax(-1, keepdim=True) / (2 * float(calculate_range(args, "cpu")[1]))
    before = forward.calculate_range  # an in-process evaluation earlier in the session may have patched it
    upstream = forward.calculate_range = calculate_range
    try:
        for dtype in (torch.bfloat16, torch.float32):
            expected = forward.fake_quantize(x.to(dtype), scale, None, args)
            assert clamp_with_number_bounds() and not clamp_with_number_bounds()
            got = forward.fake_quantize(x.to(dtype), scale, None, args)
            forward.calculate_range = upstream
            assert got.dtype == expected.dtype and torch.equal(got, expected)
        clamp_with_number_bounds()
        on_meta = forward.fake_quantize(x.to("meta"), scale.to("meta"), None, args)  # as transformers loads
        assert on_meta.device.type == "meta" and on_meta.shape == x.shape
    finally:
        forward.calculate_range = before


def _bits(t):
    """A float tensor's bits as integers (so that -0.0 and 0.0 differ, as they do in the tensor)."""
    import torch

    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_fp8_by_lookup_rounds_to_the_same_bits():
    """Every float8 E4M3 code, and values beyond the range, through upstream's rounding and through the table:
    the same bits in each dtype; the fake quantization an FP8 layer runs gives the same tensor; INT8, and a
    rounding that keeps the float8 tensor, still go to upstream."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import forward, forward_helpers
    from compressed_tensors.quantization.quant_args import round_to_quantized_type_args

    from eval.quality import qdq_fast
    from eval.quality.qdq_fast import fp8_back_by_lookup

    fp8 = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    int8 = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    every_code = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    every_code = every_code[~every_code.isnan()]  # NaN is no value a clamped activation reaches
    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0)) * 300  # many beyond ±448
    scale = x.abs().amax(-1, keepdim=True) / 300
    before = forward_helpers.round_to_quantized_type_args  # an in-process evaluation may have patched it
    forward_helpers.round_to_quantized_type_args = round_to_quantized_type_args
    try:
        expected = {
            dtype: (
                [round_to_quantized_type_args(v.to(dtype), fp8, -448.0, 448.0) for v in (every_code, x)],
                forward.fake_quantize(x.to(dtype), scale.to(dtype), None, fp8),
            )
            for dtype in (torch.bfloat16, torch.float16, torch.float32)
        }
        assert fp8_back_by_lookup() and not fp8_back_by_lookup()
        patched = forward_helpers.round_to_quantized_type_args
        qdq_fast._TABLES.clear()  # so that the tables below are the ones these calls made
        for dtype, (rounded, fake) in expected.items():
            got = [patched(v.to(dtype), fp8, -448.0, 448.0) for v in (every_code, x)]
            for g, e in zip(got, rounded, strict=True):
                assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(_bits(g), _bits(e))
            got_fake = forward.fake_quantize(x.to(dtype), scale.to(dtype), None, fp8)
            assert torch.equal(_bits(got_fake), _bits(fake))
        assert set(qdq_fast._TABLES) == set(expected)  # the table did the casting back, in each dtype
        across = x.transpose(0, 2)  # not contiguous: torch's cast, which keeps the layout
        assert torch.equal(
            _bits(patched(across, fp8, -448.0, 448.0)), _bits(round_to_quantized_type_args(across, fp8, -448.0, 448.0))
        )
        kept = patched(x, fp8, -448.0, 448.0, cast_to_original_dtype=False)
        assert kept.dtype == torch.float8_e4m3fn
        assert torch.equal(patched(x, int8, -128.0, 127.0), round_to_quantized_type_args(x, int8, -128.0, 127.0))
    finally:
        forward_helpers.round_to_quantized_type_args = before


def test_log_softmax_over_scored_rows_gives_upstreams_records(tmp_path, monkeypatch):
    """lm-eval's log-likelihood loop with the log-softmax over the rows it scores (eval/quality/scored_rows.py) writes
    the records upstream's writes, byte for byte: a rolling task (every position scored), the needle (a verse's
    rest after hundreds of positions) and a multiple-choice task; a class with a loop of its own (whose logits
    come log-softmaxed) gets upstream's selection."""
    import torch
    import torch.nn.functional as torch_F
    from lm_eval.models import huggingface

    from eval.quality import scored_rows

    patched = huggingface.HFLM._select_cont_toks  # an in-process evaluation earlier in the session may have patched
    monkeypatch.setattr(huggingface, "F", torch_F)
    monkeypatch.setattr(huggingface.HFLM, "_select_cont_toks", getattr(patched, "upstream", patched))
    cfg = accuracy.AccuracyConfig(
        checkpoint=str(REPO / "refmodel/ref-lm"),
        tasks=["refkjv_ppl", "refkjv_needle", "refkjv_next_verse"],
        include_path=str(REPO / "eval/tasks/refkjv"),
        num_fewshot=0,
        limit=4,
        batch_size=4,
        seed=0,
    )
    for way, patch in (("upstream", lambda: False), ("scored_rows", scored_rows.log_softmax_scored_rows)):
        monkeypatch.setattr(accuracy, "log_softmax_scored_rows", patch)
        (tmp_path / way).mkdir()
        accuracy.evaluate_accuracy(cfg, tmp_path / way)
        assert (huggingface.F is torch_F) == (way == "upstream")  # patched, the module's `F` defers the log-softmax
    for task in cfg.tasks:
        name = f"samples_{task}.jsonl"
        assert (tmp_path / "upstream" / name).read_bytes() == (tmp_path / "scored_rows" / name).read_bytes(), task

    class OwnLoop(huggingface.HFLM):
        def _loglikelihood_tokens(self, *args, **kwargs):
            raise NotImplementedError

    own = OwnLoop.__new__(OwnLoop)
    own.backend, own.softmax_dtype = "causal", torch.float32
    logits = torch.randn(10, 16).log_softmax(-1)
    assert torch.equal(huggingface.HFLM._select_cont_toks(own, logits, contlen=3, inplen=8), logits[5:8])


def test_a_zero_point_of_plus_zero_left_unsubtracted_gives_the_same_bits():
    """compressed-tensors' fused quantize-dequantize with the zero point's subtraction left out where it is +0.0
    (eval/quality/qdq_fast.py): INT8's and FP8's fake quantization, -0.0 and values that round to zero from either side
    among the inputs, the same bits in each dtype; a zero point that is not +0.0 everywhere (-0.0, or an
    asymmetric scheme's) goes to upstream."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import forward, forward_helpers

    from eval.quality.qdq_fast import zero_point_not_subtracted

    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, :32] = -0.0
    x[1, 1, :16], x[1, 1, 16:32] = 1e-30, -1e-30
    scale = x.abs().amax(-1, keepdim=True) / 100
    before = forward_helpers._quantize_dequantize  # an in-process evaluation may have patched it
    upstream = getattr(before, "upstream", before)
    cases = []
    for kind in ("int", "float"):
        args = QuantizationArgs(num_bits=8, type=kind, strategy="token", symmetric=True, dynamic=True)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for zero in (0.0, -0.0, 3.0):
                cases.append((x.to(dtype), scale.to(dtype), torch.full_like(scale, zero, dtype=dtype), args))
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return upstream(*a, **k)

    forward_helpers._quantize_dequantize = counted
    try:
        expected = [forward.fake_quantize(*c) for c in cases]
        calls.clear()
        assert zero_point_not_subtracted() and not zero_point_not_subtracted()
        for (xs, scale_, zp, args), e in zip(cases, expected, strict=True):
            calls.clear()
            got = forward.fake_quantize(xs, scale_, zp, args)
            assert got.dtype == e.dtype and torch.equal(_bits(got), _bits(e)), (args.type, xs.dtype, zp.flatten()[0])
            assert len(calls) == (1 if _bits(zp).any() else 0)  # upstream's path only for a zero point not +0.0
    finally:
        forward_helpers._quantize_dequantize = before
