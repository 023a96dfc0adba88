"""The precision registry: every entry walked through everything that reads it."""

from __future__ import annotations

import json

import pytest

from eval.devices.gpus import CATALOG, get_gpu
from eval.devices.sizing import Shape, fit, weight_bytes
from pipelines.core.store.results import Quantized
from pipelines.core.system.paths import REPO_ROOT
from pipelines.tracking.mapping import logged
from quant.build import QuantizeConfig
from quant.execution import CPU, DEQUANTIZED, Device, Execution, compute_dtype, cpu_flags, execution
from quant.precisions import PRECISIONS, build_recipe, get_precision, kv_cache_dtype
from quant.recipes import IGNORE, RecipeOptions
from quant.verify import check_quantization_config

LLAMA3_8B = Shape.from_config(json.loads((REPO_ROOT / "pipelines/models/configs/llama-3.1-8b.json").read_text()))


def _saved_config(p) -> dict:
    """What a compressed-tensors checkpoint of `p` declares in its config.json."""
    group = {"weights": {"num_bits": p.weight_bits}}
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": p.checkpoint_format,
            "config_groups": {"group_0": group},
        }
    }


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_every_precision_through_recipe_proof_sizing_gpus_and_tracking(name):
    p = get_precision(name)
    recipe = build_recipe(name, RecipeOptions(group_size=64, ignore=list(IGNORE)))
    if p.weight_bits == 16:
        assert recipe is None and p.checkpoint_format is None and not p.needs_calibration
    else:
        assert recipe and all(type(m).__name__.endswith("Modifier") for m in recipe)
        assert check_quantization_config(_saved_config(p), name) == (p.checkpoint_format, p.weight_bits)
        groups = [g for m in recipe for g in (getattr(m, "config_groups", None) or {}).values()]
        # the card's group size reaches the recipe, but where the format fixes one (NVFP4's 16, W4A8's 128)
        assert all(g.weights.group_size in (p.group or 64, None) for g in groups)
    # bytes per weight: the bits, plus a 16-bit scale (and a zero point) per group for grouped precisions
    assert p.bytes_per_weight(128) >= p.weight_bits / 8
    assert (p.bytes_per_weight(64) > p.bytes_per_weight(128)) == (p.grouped and p.group is None)
    assert weight_bytes(LLAMA3_8B, name, 64) >= weight_bytes(LLAMA3_8B, name, 128)
    # every GPU of the catalog runs it somehow or says why not, and its prefill floor uses the units it runs on
    for gpu in CATALOG:
        f = fit(LLAMA3_8B, name, gpu, batch=1, input_len=128, output_len=1, group_size=64)
        assert f.execution == execution(name, gpu.device) in ("native", "weight-only", "emulated", "no-kernel")
        assert (f.execution == "no-kernel") == bool(f.why_not)
        assert gpu.compute_flops(name) >= gpu.bf16_flops
    # what the build logs says what it is, at the card's group size
    cfg = QuantizeConfig(base="b", precision=name, group_size=64, ignore=list(IGNORE))
    params = logged(Quantized(checkpoint="c", checkpoint_bytes=1, scheme=p.describe(64), config=cfg)).params
    assert params["quant.scheme"] == p.describe(64)
    assert (str(p.group_size(64)) in params["quant.scheme"]) == p.grouped


def test_how_each_gpu_generation_runs_each_precision():
    runs = {g: {n: get_gpu(g).execution(n) for n in PRECISIONS} for g in ("a100-80gb", "l4", "h100-sxm")}
    assert runs["a100-80gb"] == {
        "bf16": "native",
        "fp8": "weight-only",
        "int8": "native",
        "awq": "weight-only",
        "gptq": "weight-only",
        "fp8-block": "weight-only",  # Marlin: CUTLASS's block FP8 from 9.0
        "w4a8": "no-kernel",  # vLLM's W4A8-FP8 scheme at 9.0 alone
        "nvfp4a16": "weight-only",
        "nvfp4": "weight-only",  # no FP4 tensor cores before Blackwell: Marlin, activations kept wide
    }
    assert runs["h100-sxm"]["fp8"] == runs["l4"]["fp8"] == "native"
    h100 = get_gpu("h100-sxm")
    assert h100.compute_flops("fp8") == h100.fp8_flops and h100.compute_flops("awq") == h100.bf16_flops
    assert get_gpu("a100-80gb").compute_flops("fp8") == get_gpu("a100-80gb").bf16_flops  # weight-only: 16-bit math
    assert execution("fp8", Device("cuda", (7, 0))) == "unknown"  # below the kernel table's first class, 8.0


def test_execution_is_one_function_of_the_precision_the_device_and_the_kernel():
    """What each engine reported for ref-lm's builds (docs/toolchain.md), and what sizing assumes per GPU."""
    on_cpu = {
        "int8": "CPUInt8ScaledMMLinearKernel",
        "awq": "CPUWNA16LinearKernel",
        "gptq": "CPUWNA16LinearKernel",
        "fp8": "ChannelWiseTorchFP8ScaledMMLinearKernel",
    }
    assert {p: execution(p, CPU, k) for p, k in on_cpu.items()} == {
        "int8": Execution.NATIVE,  # oneDNN's int8 GEMM
        "awq": Execution.WEIGHT_ONLY,  # 4-bit weights unpacked in the kernel, 16-bit compute
        "gptq": Execution.WEIGHT_ONLY,
        "fp8": Execution.EMULATED,  # torch._scaled_mm without AMX-FP8
    }
    assert execution("bf16", CPU) == execution("bf16", CPU, DEQUANTIZED) == Execution.NATIVE
    assert {execution(p, CPU, DEQUANTIZED) for p in on_cpu} == {Execution.EMULATED}  # transformers
    assert execution("int8", CPU) == Execution.UNKNOWN  # vLLM said nothing of its kernel
    hopper, ampere = Device("cuda", (9, 0)), Device("cuda", (8, 0))
    assert execution("fp8", hopper, "CutlassFP8ScaledMMLinearKernel") == Execution.NATIVE
    # the same FP8 build below compute capability 8.9 runs on Marlin: weight-only, as the registry says
    assert execution("fp8", ampere, "MarlinFP8ScaledMMLinearKernel") == execution("fp8", ampere) == "weight-only"
    assert execution("awq", hopper, "MachetteLinearKernel") == Execution.WEIGHT_ONLY  # no 4-bit tensor cores
    assert execution("int8", Device("cuda")) == Execution.UNKNOWN  # a GPU of unknown capability


def test_transformers_computes_in_bf16_only_where_the_hardware_multiplies_it(tmp_path):
    """float32 on a CPU without bf16 units (torch emulates bf16 products there, several times slower)."""
    avx2 = frozenset({"avx", "avx2", "fma"})
    assert compute_dtype(CPU, avx2) == compute_dtype(CPU, avx2 | {"avx512f", "avx512_vnni"}) == "float32"
    assert (
        compute_dtype(CPU, avx2 | {"avx512f", "avx512_bf16"}) == compute_dtype(CPU, avx2 | {"amx_bf16"}) == "bfloat16"
    )
    assert compute_dtype(CPU, frozenset({"fp", "asimd", "bf16"})) == "bfloat16"  # Arm's FEAT_BF16
    assert compute_dtype(Device("cuda", (9, 0)), frozenset()) == "bfloat16"
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu avx2 amx_bf16\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()  # not Linux: no flags, so float32 on a CPU


def test_unknown_precision_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown precision 'gtpq' \(did you mean 'gptq'\?\); known: bf16"):
        get_precision("gtpq")


def test_a_kv_cache_variant_is_its_precision_with_another_kv_cache():
    """int8+kv-fp8: int8's weights, format and kernels, an FP8 KV cache, and nothing of its own to build."""
    base, variant = get_precision("int8"), get_precision("int8+kv-fp8")
    assert (variant.name, variant.kv_cache, variant.shares, variant.needs_calibration) == (
        "int8+kv-fp8",
        "fp8",
        "int8",
        False,
    )
    assert (variant.weight_bits, variant.checkpoint_format, variant.recipe) == (8, "int-quantized", base.recipe)
    assert variant.describe(128).endswith("; FP8 KV cache")
    assert (kv_cache_dtype("int8+kv-fp8", "auto"), kv_cache_dtype("int8", "auto"), kv_cache_dtype("int8", "fp8")) == (
        "fp8",
        "auto",
        "fp8",
    )
    with pytest.raises(ValueError, match="unknown precision 'int9'"):
        get_precision("int9+kv-fp8")


def test_a_kv_cache_variant_runs_in_its_precisions_ray_task():
    """On Ray a variant's chain follows its precision's on the node that holds that checkpoint."""
    from pipelines.fanout import tasks_of

    assert tasks_of(["bf16", "int8", "fp8", "int8+kv-fp8", "bf16+kv-fp8"]) == {
        "bf16": ["bf16", "bf16+kv-fp8"],
        "int8": ["int8", "int8+kv-fp8"],
        "fp8": ["fp8"],
    }
