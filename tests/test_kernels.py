"""The kernel table (quant/kernels.py): what runs each format where, and what the stages make of it."""

from __future__ import annotations

import json

import pytest
from helpers import REPO

import pipelines.decision.pricing as pricing
from eval.devices.gpus import CATALOG, get_gpu
from eval.devices.sizing import Assumptions, Shape, fit
from pipelines.cli_kernels import table_rows
from pipelines.core.card.cards import load_card
from pipelines.core.store.results import Sized
from pipelines.stages.engines import vllm_cannot_run
from quant import kernels
from quant.execution import execution, runs, runs_on
from quant.kernels import CLASSES, CPU, TABLE, Device
from quant.precisions import PRECISIONS, get_precision

AVX2, AVX512, AMX = frozenset({"avx2"}), frozenset({"avx2", "avx512f"}), frozenset({"avx512f", "amx_tile", "amx_int8"})
CPUS = {"cpu-avx2": AVX2, "cpu-avx512": AVX512, "cpu-amx": AMX}
GPUS = {"sm80": (8, 0), "sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}


def test_the_table_answers_for_every_format_and_device_class():
    for fmt, row in TABLE.items():
        assert set(row) == set(CLASSES), fmt
        for cls, k in row.items():
            assert k.runs == (k.execution != "no-kernel"), (fmt, cls)
            assert k.runs or k.why, f"{fmt} on {cls}: no kernel and no reason"
    for p in PRECISIONS.values():
        assert set(p.formats) <= set(TABLE), p.name
    rows = table_rows(list(PRECISIONS))
    assert len(rows) == len(PRECISIONS) * len(CLASSES) and all(r["runs"] for r in rows)


def test_device_classes():
    assert [kernels.device_class(CPU, f, "x86_64") for f in (AVX2, AVX512, AMX)] == list(CPUS)
    assert kernels.device_class(CPU, AVX512, "aarch64") is None  # not the x86 table
    got = [kernels.device_class(Device("cuda", c)) for c in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 1))]
    assert got == ["sm80", "sm80", "sm89", "sm90", "sm100", "sm100", "sm120"]
    assert kernels.device_class(Device("cuda", (7, 5))) is None and kernels.device_class(Device("cuda")) is None


@pytest.mark.parametrize("cls", list(CPUS))
def test_vllms_cpu_build_is_never_handed_a_format_without_its_kernel(cls):
    flags = CPUS[cls]
    for name in PRECISIONS:
        row = runs_on(name, cls)
        cannot = vllm_cannot_run(name, CPU, flags, "x86_64", dtype="bfloat16")
        assert (cannot is None) == row.runs, (name, cls)
        if not row.runs:
            assert cannot == row.why
    # 4-bit weights: AVX-512 only, and never in float32
    assert vllm_cannot_run("gptq", CPU, flags, "x86_64", dtype="float32") is not None
    assert vllm_cannot_run("int8", CPU, flags, "x86_64", dtype="float32") is None


def test_int8_w8a8_has_no_kernel_on_blackwell():
    for cap in ((10, 0), (12, 0)):
        row = runs("int8", Device("cuda", cap))
        assert not row.runs and row.execution == "no-kernel" and "54311" in row.why
        assert execution("int8", Device("cuda", cap)) == "no-kernel"
        assert vllm_cannot_run("int8", Device("cuda", cap)) == row.why
    assert all(execution("int8", Device("cuda", c)) == "native" for c in ((8, 0), (8, 9), (9, 0)))
    b200 = get_gpu("b200")
    assert b200.why_not("int8") and b200.why_not("fp8") is None
    f = fit(_shape(), "int8", b200, batch=1, input_len=128, output_len=16, group_size=128)
    assert f.execution == "no-kernel" and f.why_not == b200.why_not("int8")
    assert b200.compute_flops("int8") == b200.bf16_flops  # not its INT8 units: nothing runs them


def test_nvfp4_is_native_only_from_blackwell_and_never_on_a_cpu():
    native = {cls for cls in CLASSES if runs_on("nvfp4", cls).execution == "native"}
    assert native == {"sm100", "sm120"}
    assert {runs_on("nvfp4", c).execution for c in ("sm80", "sm89", "sm90")} == {"weight-only"}  # Marlin's FP4
    assert all(not runs_on(p, c).runs for p in ("nvfp4", "nvfp4a16") for c in kernels.CPU_CLASSES)
    assert get_gpu("b200").compute_flops("nvfp4") == get_gpu("b200").fp4_flops
    assert get_gpu("h100-sxm").compute_flops("nvfp4") == get_gpu("h100-sxm").bf16_flops  # weight-only: 16-bit math


def test_a_mixed_build_runs_where_both_its_formats_do():
    assert runs("gptq+3xint8", Device("cuda", (9, 0))).execution == "mixed"
    assert not runs("gptq+3xint8", Device("cuda", (10, 0))).runs  # its INT8 layers have no kernel there
    assert runs("fp8+1xbf16", Device("cuda", (9, 0))).execution == "native"  # the kept layers in 16 bits
    assert execution("gptq", Device("cuda", (9, 0)), "MarlinLinearKernel") == "weight-only"


def test_a_cpu_kernel_vllm_reported_labels_the_figures():
    assert execution("int8", CPU, "CPUInt8ScaledMMLinearKernel") == "native"
    assert execution("gptq", CPU, "CPUWNA16LinearKernel") == "weight-only"
    assert execution("fp8", CPU, "ChannelWiseTorchFP8ScaledMMLinearKernel") == "emulated"
    assert execution("fp8", CPU, "SomeKernelOfALaterVllm") == "unknown"
    assert execution("fp8", CPU) == "unknown" and execution("bf16", CPU) == "native"


def test_every_gpu_of_the_catalog_has_a_class_and_its_peaks():
    for gpu in CATALOG:
        assert kernels.device_class(gpu.device) in kernels.GPU_CLASSES, gpu.name
        assert (gpu.fp8_flops is not None) == (gpu.capability >= (8, 9)), gpu.name
        assert (gpu.fp4_flops is not None) == (gpu.capability >= (10, 0)), gpu.name


def test_qeval_kernels_prints_the_table():
    from typer.testing import CliRunner

    from pipelines.cli import app

    done = CliRunner().invoke(app, ["kernels", "--precision", "int8", "--json"])
    assert done.exit_code == 0, done.output
    rows = json.loads(done.output.strip().splitlines()[-1])["kernels"]
    assert [r["device"] for r in rows] == list(CLASSES)
    assert {r["device"]: r["runs"] for r in rows}["sm100"] == "no-kernel"
    bad = CliRunner().invoke(app, ["kernels", "--precision", "int3"])
    assert bad.exit_code == 2 and "unknown precision" in bad.output


def _shape() -> Shape:
    return Shape(layers=2, hidden=256, intermediate=768, heads=4, kv_heads=2, head_dim=64, vocab=4096, tied=False)


def test_registry_names_are_the_tables():
    assert get_precision("int8+kv-fp8").formats == ("int8",)
    assert get_precision("bf16").formats == ()


def test_a_build_no_kernel_runs_on_a_gpu_is_not_priced_there(monkeypatch):
    card = load_card("llama-3.1-8b-instruct")
    card = card.model_copy(update={"traffic": card.traffic.model_copy(update={"prices": {"b200": 5.0}})})
    shape = Shape.from_config(json.loads((REPO / "pipelines/models/configs/llama-3.1-8b.json").read_text()))
    fits = [
        fit(shape, "int8", get_gpu(g), batch=1, input_len=512, output_len=256, group_size=128) for g in ("b200", "h200")
    ]
    sized = Sized(
        batch=1,
        input_len=512,
        output_len=256,
        group_size=128,
        weights_bytes=8.5e9,
        weights_from="from config",
        weights_bytes_from_config=8.5e9,
        kv_bytes_per_token=131072,
        assumptions=Assumptions(),
        fits=fits,
    )
    monkeypatch.setattr(pricing, "result_of", lambda model, p, kind: sized if kind is Sized else None)
    cells, _ = pricing.cells_of(card, "int8")
    assert cells["b200"].per is None and cells["b200"].cost.instances is None
    assert cells["b200"].cost.why.startswith("no kernel runs it: vLLM 0.32 picks CUTLASS's INT8 kernel")
    assert cells["h200"].per is not None and cells["h200"].cost.instances  # projected where a kernel runs it
