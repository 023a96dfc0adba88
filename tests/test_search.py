"""The mixed-precision search (pipelines/search.py): mixed builds' names and recipes, the card's `search:`
section, the bisection against a constructed monotone judge, the first guess on a frontier by hand, a mixed
checkpoint's declared format checked, how vLLM's kernels for it ran (unit); a mix's shape build declared as the
session's pipeline run built and served it (slow)."""

from __future__ import annotations

import math

import pytest
from helpers import REPO

from eval.quality.stats import Verdict
from pipelines.core.card.cards import load_card
from pipelines.core.card.search import Search
from pipelines.core.store.results.ranked import Candidate, Ranked, RankedGroup
from pipelines.core.store.searches import Tried
from pipelines.core.system.errors import QevalError
from pipelines.search import bisect, candidates, first_guess
from quant.execution import CPU, Execution, execution
from quant.precisions import get_precision, mix_name
from quant.verify import check_quantization_config

REF_CARD = (REPO / "pipelines/models/ref-lm.yaml").read_text()


def test_a_mixed_builds_name_says_its_make_up():
    p = get_precision("gptq+3xint8")
    assert mix_name("gptq", 3, "int8") == "gptq+3xint8" and p.name == "gptq+3xint8"
    assert (p.mix.target, p.mix.kept, p.mix.fallback) == ("gptq", 3, "int8")
    assert p.checkpoint_format == "mixed-precision" and p.weight_bits == 4 and p.needs_calibration
    assert p.formats == ("w4a16", "int8")  # its kernels: both formats' rows of the kernel table (tests/test_kernels.py)
    assert "3 most sensitive layer groups at int8" in p.describe(128)
    assert get_precision("gptq+2xbf16").checkpoint_format == "pack-quantized"  # kept layers unquantized: one format
    assert get_precision("fp8+1xbf16").checkpoint_format == "float-quantized"
    for bad, says in (("awq+2xint8", "not 'awq'"), ("int8+2xgptq", "wider format"), ("gptq+2xfp4", "fp4")):
        with pytest.raises(ValueError, match=says):
            get_precision(bad)


def test_a_mixed_recipe_gives_each_layer_its_own_scheme_by_name():
    from quant.precisions import build_recipe
    from quant.recipes import RecipeOptions, import_quietly

    import_quietly()
    at, kept = ("model.layers.0.mlp.down_proj",), ("model.layers.1.mlp.down_proj",)
    (gptq,) = build_recipe("gptq+1xint8", RecipeOptions(128, ["lm_head"], at, kept))
    schemes = {tuple(g.targets): g for g in gptq.config_groups.values()}
    assert schemes[at].weights.num_bits == 4 and schemes[at].input_activations is None
    assert schemes[kept].weights.num_bits == 8 and schemes[kept].input_activations.dynamic is True
    (unquantized,) = build_recipe("gptq+1xbf16", RecipeOptions(128, ["lm_head"], at, kept))
    assert len(unquantized.config_groups) == 1 and unquantized.ignore == ["lm_head", *kept]
    with pytest.raises(ValueError, match="names no layers"):
        build_recipe("gptq+1xint8", RecipeOptions(128, ["lm_head"]))


def test_a_mixed_checkpoint_declares_both_bit_widths():
    groups = {"a": {"weights": {"num_bits": 4}}, "b": {"weights": {"num_bits": 8}}}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "mixed-precision"}}
    config["quantization_config"]["config_groups"] = groups
    assert check_quantization_config(config, "gptq+2xint8") == ("mixed-precision", 4)
    del groups["b"]
    with pytest.raises(ValueError, match=r"expected mixed-precision with \[4, 8\]-bit weights"):
        check_quantization_config(config, "gptq+2xint8")


def test_each_kernel_of_a_mix_on_a_cpu_runs_its_own_format():
    assert execution("gptq+2xint8", CPU, "CPUWNA16LinearKernel") == Execution.WEIGHT_ONLY
    assert execution("gptq+2xint8", CPU, "CPUInt8ScaledMMLinearKernel") == Execution.NATIVE
    assert execution("gptq", CPU, "CPUWNA16LinearKernel") == Execution.WEIGHT_ONLY


def _card(cards, search: str) -> str:
    cards("bad", REF_CARD.replace("name: ref-lm", "name: bad").replace(REF_SEARCH, search))
    with pytest.raises(QevalError) as e:
        load_card("bad")
    assert "\n" not in str(e.value) and "bad.yaml" in str(e.value)
    return str(e.value)


REF_SEARCH = "search:\n  target: gptq\n  fallback: int8\n"


def test_the_cards_search_section_is_checked(cards):
    assert load_card("ref-lm").search.target == "gptq"
    assert "key 'search.target': a mixed build's layers go to one of fp8, int8, gptq, nvfp4, not 'awq'" in _card(
        cards, "search:\n  target: awq+1xint8\n  fallback: int8\n"
    )
    assert "target 'bf16' is not among" in _card(cards, "search:\n  target: bf16\n  fallback: int8\n")
    assert "not 'awq'" in _card(cards, "search:\n  target: awq\n  fallback: int8\n")
    assert "wider format than int8's, not gptq" in _card(cards, "search:\n  target: int8\n  fallback: gptq\n")
    assert "key 'search.fallback': not a precision" in _card(cards, "search:\n  target: gptq\n  fallback: fp16\n")
    assert "max_evaluations" in _card(cards, REF_SEARCH + "  max_evaluations: 0\n")
    assert "max_effective_bits" in _card(cards, REF_SEARCH + "  max_effective_bits: 17\n")
    assert "budget" in _card(cards, REF_SEARCH + "  budget: 3\n")  # an unknown key, named


def _monotone(threshold: int, calls: list[int]):
    def judge(k: int) -> Verdict:
        calls.append(k)
        return Verdict.PASS if k >= threshold else Verdict.FAIL

    return judge


@pytest.mark.parametrize("n", [1, 2, 5, 23])
def test_the_bisection_finds_the_fewest_groups_a_monotone_judge_passes(n):
    bound = 1 + math.ceil(math.log2(n))  # the first guess, then halving what is left
    for threshold in range(1, n + 2):  # n + 1: no mix in [1, n] passes
        for first in range(1, n + 1):
            calls: list[int] = []
            best, why = bisect(first, 1, n, _monotone(threshold, calls), budget=99)
            assert best == (threshold if threshold <= n else None), (n, threshold, first)
            assert calls[0] == first and len(calls) <= bound and len(set(calls)) == len(calls)
            assert why == ("bisection done" if best else "every mix within the budget fails")


def test_the_bisection_stops_at_its_budget_and_at_a_verdict_the_tasks_cannot_decide():
    calls: list[int] = []
    best, why = bisect(20, 1, 23, _monotone(3, calls), budget=2)
    assert calls == [20, 10] and best == 10 and why == "the 2 evaluations the card allows spent"
    undecided = bisect(12, 1, 23, lambda k: Verdict.INCONCLUSIVE if k < 15 else Verdict.PASS, budget=5)
    assert undecided == (None, "the tasks cannot decide a mix keeping 12 groups (INCONCLUSIVE)")


def _ranked(kls: list[float]) -> Ranked:
    groups = [RankedGroup(group=f"g{i}", modules=[f"m{i}"], parameters=10, kl=0.1) for i in range(len(kls) - 1)]
    frontier = [
        Candidate(kept=k, precision=f"p{k}", weight_bytes=k, effective_bits=4, predicted_kl=v)
        for k, v in enumerate(kls)
    ]
    return Ranked(
        precision="gptq",
        fallback="int8",
        scheme="",
        tokens=1,
        ranked=groups,
        top_half_kl=1,
        bottom_half_kl=0,
        frontier=frontier,
    )


def test_the_first_mix_tried_closes_most_of_the_predicted_gap():
    # uniform target 1.0, uniform fallback 0.0: the bar is 0.1, first met keeping 3 groups
    r = _ranked([1.0, 0.5, 0.2, 0.09, 0.05, 0.0])
    assert first_guess(r, [1, 2, 3, 4]) == 3
    assert first_guess(r, [1, 2]) == 2  # the budget stops short of the bar: the most it allows
    assert first_guess(r, [4]) == 4
    assert r.modules(2) == (["m2", "m3", "m4"], ["m0", "m1"])
    with pytest.raises(ValueError, match="keeps 1 to 4 of 5 groups"):
        r.modules(5)


@pytest.mark.slow
def test_a_mixs_shape_build_declares_what_its_real_build_declares(pipeline_run, tmp_path):
    """The session's pipeline run served its search's mix on vLLM, one kernel per format (tests/test_pipeline.py):
    a shape build of that mix (random weights, quant/shape_build.py) declares the same two schemes over the same
    layers, every field vLLM picks a kernel by, so vLLM builds it as it built the real one."""
    import json

    from quant.recipes import RecipeOptions
    from quant.shape_build import write_shape_build

    mix = pipeline_run.doc["search"]["carried"]
    built = pipeline_run.root / "artifacts/ref-small" / mix / "quantize"
    config = json.loads((built / "manifest.json").read_text())["result"]["config"]
    real = json.loads((built / "checkpoint/config.json").read_text())["quantization_config"]
    opts = RecipeOptions(128, ["lm_head"], tuple(config["target_modules"]), tuple(config["fallback_modules"]))
    build = write_shape_build(REPO / "refmodel/ref-lm/config.json", mix, opts, tmp_path / "build")
    shape = json.loads((build / "config.json").read_text())["quantization_config"]
    fields = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")

    def schemes(q: dict) -> dict:
        return {
            g["format"]: (
                sorted(g["targets"]),
                {k: g["weights"][k] for k in fields},
                g["input_activations"] and {k: g["input_activations"][k] for k in fields},
            )
            for g in q["config_groups"].values()
        }

    assert set(schemes(shape)) == {"pack-quantized", "int-quantized"} and schemes(shape) == schemes(real)
    assert {k: v for k, v in shape.items() if k != "config_groups"} == {
        k: v for k, v in real.items() if k != "config_groups"
    }


def _uniform(precision: str, verdict: Verdict, mb: float) -> Tried:
    return Tried(precision=precision, kept=-1, weight_bytes=mb * 1e6, predicted_kl=None, verdict=verdict)


def test_mixes_are_tried_only_where_they_could_be_the_cheapest_build_that_passes():
    # five groups; the mix keeping k takes 6 + k/2 MB and 4 + k/2 bits per weight (int8 at k = 5)
    frontier = _ranked([1.0, 0.5, 0.2, 0.1, 0.05, 0.0]).frontier
    frontier = [
        c.model_copy(update={"weight_bytes": (6 + c.kept / 2) * 1e6, "effective_bits": 4 + c.kept / 2})
        for c in frontier
    ]
    s = Search(target="gptq", fallback="int8")
    undecided = [_uniform("gptq", Verdict.INCONCLUSIVE, 6), _uniform("int8", Verdict.INCONCLUSIVE, 8.5)]
    assert candidates(s, frontier, undecided, "bf16") == ([1, 2, 3, 4], "")
    fp8 = _uniform("fp8", Verdict.PASS, 7.2)  # a uniform build that passes bounds the mixes' bytes
    assert candidates(s, frontier, [*undecided, fp8], "bf16") == ([1, 2], "")
    small = _uniform("awq", Verdict.PASS, 6.2)
    allowed, why = candidates(s, frontier, [*undecided, small], "bf16")
    assert (
        allowed == [] and why == "awq passes with 6.20 MB of weights, fewer than any mix of gptq with int8 would take"
    )
    assert candidates(s, frontier, [_uniform("gptq", Verdict.PASS, 6), undecided[1]], "bf16")[1].startswith(
        "gptq passes as it is"
    )
    assert (
        "int8 itself fails" in candidates(s, frontier, [undecided[0], _uniform("int8", Verdict.FAIL, 8.5)], "bf16")[1]
    )
    budget = Search(target="gptq", fallback="int8", max_effective_bits=5.0, max_weight_gb=0.0069)
    assert candidates(budget, frontier, undecided, "bf16") == ([1], "")  # 6.5 MB and 4.5 bits; 7 MB is over
    assert (
        "within the card's budget"
        in candidates(Search(target="gptq", fallback="int8", max_effective_bits=4.2), frontier, undecided, "bf16")[1]
    )
    assert candidates(Search(target="gptq", fallback="bf16"), frontier, undecided[:1], "bf16") == ([1, 2, 3, 4], "")


def test_a_search_whose_target_passes_as_it_is_has_its_answer():
    """`qeval search` exited 1 where its target passed uniformly, which CI reads as a failure (issue 67)."""
    from pipelines.core.store.searches import Searched

    def found(target_verdict: Verdict, chosen: str | None = None) -> Searched:
        uniform = [Tried(precision="gptq", kept=0, weight_bytes=1.0, predicted_kl=None, verdict=target_verdict)]
        return Searched(
            model="m",
            target="gptq",
            fallback="int8",
            groups=2,
            most_sensitive=[],
            top_half_kl=0.0,
            bottom_half_kl=0.0,
            frontier=[],
            first=None,
            uniform=uniform,
            tried=[],
            max_evaluations=1,
            chosen=chosen,
            carried=chosen,
            why="",
        )

    assert found(Verdict.PASS).answered and found(Verdict.FAIL, chosen="gptq+1xint8").answered
    assert not found(Verdict.INCONCLUSIVE).answered
