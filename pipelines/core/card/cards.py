"""Model cards: one strictly validated YAML file per model under pipelines/models/.

A card says where the weights come from, which precisions to build, the calibration data, the
accuracy tasks, the speed grid, the target GPUs and the gate policy. Unknown keys are errors; every
error is one line naming the file, the key and what is expected.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from eval.load.edge import EdgeSearch
from pipelines.core.card.card_errors import UniqueKeys, describe
from pipelines.core.card.gating import Gate
from pipelines.core.card.names import CPU, GpuName, PrecisionName, TaskName
from pipelines.core.card.search import Search, search_problem
from pipelines.core.card.traffic import Traffic
from pipelines.core.system.errors import QevalError
from pipelines.core.system.paths import cards_dir
from quant import recipes
from quant.lookup import suggest
from quant.precisions import get_precision, variants_problem

PositiveInt = Annotated[int, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Strict):
    """Where the base model's weights come from: a local folder or a hub id at a revision."""

    path: str | None = Field(None, description="local checkpoint folder, absolute or relative to the repo")
    hub_id: str | None = Field(None, description="hub repository id, e.g. meta-llama/Llama-3.1-8B-Instruct")
    revision: str = Field("main", description="hub revision (a commit hash pins it)")
    trust_remote_code: bool = Field(False, description="run code shipped with the model; only if its card asks")
    config: str | None = Field(
        None, description="a config.json in the repo giving the architecture, for work without the weights"
    )

    @model_validator(mode="after")
    def _one_source(self) -> Source:
        if (self.path is None) == (self.hub_id is None):
            raise ValueError("give exactly one of 'path' or 'hub_id'")
        return self

    @property
    def location(self) -> str:
        """The local path, or `hub_id@revision`."""
        return self.path or f"{self.hub_id}@{self.revision}"


class Calibration(_Strict):
    """Calibration text for the precisions that need it (int8, awq, gptq)."""

    dataset: str = Field(description="a local JSONL file (relative to the repo) or a hub data set id")
    split: str = Field("train", description="split of a hub data set")
    text_field: str = Field("text", description="field holding the text")
    num_samples: PositiveInt = Field(64, description="samples used for calibration")
    max_seq_length: PositiveInt = Field(512, description="tokens per calibration sample, at most")


class Quantization(_Strict):
    """Overrides of the precisions' defaults."""

    group_size: PositiveInt = Field(recipes.GROUP_SIZE, description="input channels per weight scale for 4-bit builds")
    ignore: list[str] = Field(list(recipes.IGNORE), description="modules left unquantized")


Shots = Annotated[int, Field(ge=0)]


class Accuracy(_Strict):
    """lm-eval settings, identical for every build of the model."""

    tasks: list[TaskName] = Field(min_length=1, description="lm-eval task names")
    include_path: str | None = Field(None, description="folder of local task YAMLs, relative to the repo")
    num_fewshot: Shots | dict[TaskName, Shots] | None = Field(
        None,
        description="few-shot examples per prompt: one number for every task, or per task ({mmlu: 5}; a task "
        "not named keeps its own); null: each task's own default (gsm8k's 5, most others' 0)",
    )
    limit: PositiveInt | None = Field(None, description="documents per task (None: all)")
    batch_size: PositiveInt = Field(8, description="documents per forward on the transformers engine")
    seed: int = Field(1234, description="seed for sampling few-shot examples and for tasks that generate documents")
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto",
        description="the engine of record that scores every build: auto: vLLM on a GPU (lm-eval's vllm backend, in "
        "the engine's environment, .venv-vllm), transformers on a CPU (where it scores faster); recorded as "
        "each evaluation's eval.backend",
    )
    max_length: PositiveInt | None = Field(
        None,
        description="tokens per context window; null: the model's positions, at most server.max_model_len (a "
        "long-context model's 131,072 would make a batch of logits no GPU holds)",
    )
    max_seq_lengths: list[PositiveInt] | None = Field(
        None, description="document lengths of RULER's niah_* tasks, each within max_length; null: lm-eval's 4,096"
    )


# What one grid point may ask for at most, whatever the machine: beyond these a card is a typo, not a plan
# (a batch or a user count of 100,000 allocated 6.25 GB, or opened 400,000 streams, before anything said no).
MAX_BATCH, MAX_USERS, MAX_TOKENS = 4096, 4096, 1 << 20
Batch = Annotated[int, Field(gt=0, le=MAX_BATCH)]
Users = Annotated[int, Field(gt=0, le=MAX_USERS)]
Tokens = Annotated[int, Field(gt=0, le=MAX_TOKENS)]


class Slo(_Strict):
    """Latency objective per request, checked at the 95th percentile."""

    ttft_ms: float = Field(gt=0, description="time to first token, ms")
    tpot_ms: float = Field(gt=0, description="time per output token after the first, ms")


class Scenario(_Strict):
    """A named operating point the server stages sweep over concurrency: how long the prompts are, how many
    tokens each answer has, and the objective its users hold it to."""

    input_len: Tokens = Field(description="prompt tokens")
    output_len: Tokens = Field(description="output tokens")
    slo: Slo | None = Field(None, description="this scenario's objective; null: speed.slo")


NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"  # a card's name: its file, its artifacts folder, its experiment
DEFAULT_SCENARIO = "default"
"""The one scenario of a card that names none: its first input and output lengths."""


class Speed(_Strict):
    """The engine and server benchmark grid."""

    batch_sizes: list[Batch] = Field([1], min_length=1)
    input_lengths: list[Tokens] = Field([128], min_length=1, description="the engine bench's prompt lengths")
    output_lengths: list[Tokens] = Field([64], min_length=1, description="the engine bench's output lengths")
    scenarios: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")], Scenario] | None = Field(
        None,
        min_length=1,
        description="named operating points the server stages sweep (chat, rag, ...), the first the main one; "
        f"null: one, '{DEFAULT_SCENARIO}', at the first input and output lengths",
    )
    concurrency: list[Users] = Field([1], min_length=1, description="server concurrency levels")
    warmup: int = Field(2, ge=0, description="untimed runs before measuring")
    repeats: PositiveInt = Field(5, description="timed runs per grid point")
    compile: bool | None = Field(
        None, description="engine bench: static KV cache and compiled decode; null: on CUDA only, false: eager"
    )
    slo: Slo

    @property
    def input_len(self) -> int:
        """Prompt tokens of the grid's main point (its first input length), where single figures are taken."""
        return self.input_lengths[0]

    @property
    def output_len(self) -> int:
        """Output tokens of the grid's main point (its first output length)."""
        return self.output_lengths[0]

    @property
    def largest_batch(self) -> int:
        return max(self.batch_sizes)

    @property
    def operating_points(self) -> dict[str, Scenario]:
        """The scenarios the server stages sweep, in the card's order (the main one first)."""
        return self.scenarios or {DEFAULT_SCENARIO: Scenario(input_len=self.input_len, output_len=self.output_len)}

    @property
    def main_scenario(self) -> tuple[str, Scenario]:
        """The first scenario: the one the serve stage sweeps and single figures are taken at."""
        return next(iter(self.operating_points.items()))

    def slo_of(self, scenario: Scenario) -> Slo:
        return scenario.slo or self.slo

    @property
    def main_slo(self) -> Slo:
        """The objective of the main scenario: the one the serve stage's users are held to."""
        return self.slo_of(self.main_scenario[1])


class Server(_Strict):
    """The server benchmark: an OpenAI-compatible server per build, swept over speed.concurrency.

    vLLM's settings shape its command line (pipelines/stages/engines.py); `tensor_parallel` also splits lm-eval's
    in-process vLLM backend where the evaluate stage runs on it (a GPU with vLLM importable).
    """

    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto", description="auto: vLLM wherever it is installed (.venv-vllm, on a CPU too), else transformers serve"
    )
    api: Literal["completions", "chat"] = Field("completions", description="endpoint the load generator drives")
    requests_per_user: PositiveInt = Field(4, description="measured requests per level = concurrency x this")
    edge: EdgeSearch = Field(EdgeSearch(), description="levels added toward the objective's edge; requests per level")
    starts: PositiveInt = Field(
        1,
        le=10,
        description="independent starts of each build's server qeval starts: the first sweeps the grid and the edge, "
        "each other the levels the first judged with as many requests; a level's intervals then resample the starts, "
        "then their requests",
    )
    warmup: int = Field(2, ge=0, description="untimed warm-up rounds at the highest concurrency before the sweep")
    timeout_s: float = Field(120, gt=0, description="per request; a request that takes longer fails")
    warmup_timeout_s: float | None = Field(
        None,
        gt=0,
        description="the first warm-up request, which may load the model; null: 300 s for a server "
        "qeval starts (transformers serve loads at its first request), timeout_s for one you run (--url)",
    )
    start_timeout_s: float = Field(300, gt=0, description="time the server may take to answer /health")
    tensor_parallel: PositiveInt | None = Field(
        None, description="vLLM: GPUs a build is split over; null: 1, or what the size stage says it needs"
    )
    pipeline_parallel: PositiveInt = Field(1, description="vLLM: pipeline stages (nodes or GPU groups)")
    kv_cache_dtype: Literal["auto", "fp8"] = Field("auto", description="vLLM: every build's KV dtype (see +kv-fp8)")
    max_model_len: PositiveInt | None = Field(None, description="vLLM: context per sequence; null: the model's")
    enforce_eager: bool | None = Field(
        None, description="vLLM: no CUDA graphs or compilation; null: on a CPU only (where it starts faster so)"
    )
    cpu_kv_cache_gb: float = Field(
        1.0, gt=0, description="vLLM on a CPU: KV-cache space, GiB, at least (raised to hold one whole context)"
    )
    served_accuracy: bool = Field(
        False, description="also run the accuracy tasks against each build's server, beside the offline scores"
    )
    served_tasks: list[TaskName] | None = Field(None, description="tasks run against the server; null: all")
    served_limit: PositiveInt | None = Field(
        None, description="documents per task run against the server (the offline set's first N); null: all"
    )


class ModelCard(_Strict):
    """Everything qeval needs to build, measure and gate one model."""

    name: str = Field(pattern=NAME_PATTERN, description="the card's file name without .yaml")
    description: str
    source: Source
    precisions: list[PrecisionName] = Field(min_length=1)
    calibration: Calibration | None = None
    quantization: Quantization = Quantization()
    accuracy: Accuracy
    speed: Speed
    server: Server = Server()
    target_gpus: list[GpuName] = Field([], description="GPUs to size the builds for")
    gate: Gate = Gate()
    traffic: Traffic | None = Field(None, description="the load and prices the capacity and cost tables are for")
    search: Search | None = Field(None, description="the mixed-precision search (null: none)")

    @model_validator(mode="after")
    def _consistent(self) -> ModelCard:
        tasks = self.accuracy.tasks
        if problem := variants_problem(self.precisions, self.gate.baseline, self.server.kv_cache_dtype):
            raise ValueError(problem)
        if len(set(self.precisions)) != len(self.precisions):
            raise ValueError("precisions: a precision is listed twice")
        if self.gate.baseline not in self.precisions:
            raise ValueError(f"gate.baseline '{self.gate.baseline}' is not among precisions")
        needing = [p for p in self.precisions if get_precision(p).needs_calibration]
        if needing and self.calibration is None:
            raise ValueError(f"precisions {needing} need a 'calibration' section")
        if isinstance(self.accuracy.num_fewshot, dict) and (odd := set(self.accuracy.num_fewshot) - set(tasks)):
            raise ValueError(f"accuracy.num_fewshot names tasks not in accuracy.tasks: {sorted(odd)}")
        window = self.accuracy.max_length or self.server.max_model_len
        if window and (longer := [n for n in self.accuracy.max_seq_lengths or () if n > window]):
            raise ValueError(
                f"accuracy.max_seq_lengths {longer} are longer than the {window}-token context window "
                f"(accuracy.max_length, else server.max_model_len)"
            )
        served = set(self.server.served_tasks or []) - set(self.accuracy.tasks)
        if served:
            raise ValueError(f"server.served_tasks: {sorted(served)} are not among accuracy.tasks")
        if own := sorted(t for t, c in self.gate.controls.items() if t == c):
            raise ValueError(f"gate.controls: {own} would be their own controls; a control is another task")
        for key in ("task_min_recovery", "task_metric", "controls"):
            named = getattr(self.gate, key)
            if unknown := {*named, *(named.values() if key == "controls" else ())} - set(self.accuracy.tasks):
                raise ValueError(f"gate.{key} names tasks not in accuracy.tasks: {sorted(unknown)}")
        if self.gate.speed_users is not None and self.gate.speed_users not in self.speed.concurrency:
            raise ValueError(
                f"gate.speed_users {self.gate.speed_users} is not among speed.concurrency {self.speed.concurrency}"
            )
        if self.traffic and self.traffic.scenario not in (None, *self.speed.operating_points):
            raise ValueError(f"traffic.scenario '{self.traffic.scenario}' is not among speed.scenarios")
        costed = self.gate.prefer == "cost" or self.gate.max_cost_per_mtok is not None
        if costed and (self.traffic is None or self.cost_device not in self.traffic.prices):
            raise ValueError(f"gate: judging cost needs a traffic section with a price for '{self.cost_device}'")
        if self.gate.speed_batch not in self.speed.batch_sizes:
            raise ValueError(
                f"gate.speed_batch {self.gate.speed_batch} is not among speed.batch_sizes {self.speed.batch_sizes}"
            )
        if self.search is not None and (problem := search_problem(self, self.search)):
            raise ValueError(f"search: {problem}")
        return self

    @property
    def judged_users(self) -> int:
        """The concurrency the server regime judges: gate.speed_users, else the highest level."""
        return self.gate.speed_users or max(self.speed.concurrency)

    @property
    def cost_device(self) -> str:
        """The device kind the gate judges cost on: gate.cost_on, else the first target GPU, else a CPU."""
        return self.gate.cost_on or (self.target_gpus[0] if self.target_gpus else CPU)

    @property
    def sizing_gpus(self) -> list[str]:
        """The GPUs the size stage projects: the target GPUs, those the gate requires a fit on or judges cost on."""
        costed = [self.gate.cost_on] if self.gate.cost_on not in (None, CPU) else []
        return list(dict.fromkeys([*self.target_gpus, *self.gate.must_fit, *costed]))

    def with_scenarios(self, names: list[str]) -> ModelCard:
        """This card sweeping only the scenarios named (in the order given); QevalError for a name it lacks."""
        if not names:
            return self
        known = self.speed.operating_points
        for name in names:
            if name not in known:
                raise QevalError(
                    f"model '{self.name}' has no scenario '{name}'{suggest(name, list(known))}; its "
                    f"card lists: {', '.join(known)}"
                )
        chosen = {n: known[n] for n in dict.fromkeys(names)}
        return self.model_copy(update={"speed": self.speed.model_copy(update={"scenarios": chosen})})

    def scenarios_within(self, positions: int | None) -> dict[str, tuple[Scenario, str | None]]:
        """The scenarios, each cut to fit the model's positions where its prompt and output do not (the prompt
        shortened, the output kept), with a line saying how; QevalError for an output that alone does not fit."""
        fitted = {}
        for name, sc in self.speed.operating_points.items():
            if not positions or sc.input_len + sc.output_len <= positions:
                fitted[name] = (sc, None)
                continue
            if sc.output_len >= positions:
                raise QevalError(
                    f"model '{self.name}': scenario '{name}' asks for {sc.output_len} output tokens, and "
                    f"the model has {positions} positions; shorten its output_len"
                )
            cut = sc.model_copy(update={"input_len": positions - sc.output_len})
            fitted[name] = (cut, f"cut from {sc.input_len} tokens in: the model has {positions} positions")
        return fitted

    def context_window(self, positions: int | None) -> int | None:
        """Tokens per context window of the accuracy tasks, on every engine: accuracy.max_length, else the model's
        `positions` at most server.max_model_len; None where neither is known."""
        known = [n for n in (positions, self.server.max_model_len) if n]
        return self.accuracy.max_length or (min(known) if known else None)

    def require_precision(self, precision: str) -> None:
        """QevalError unless `precision` is known and built for this model."""
        try:
            get_precision(precision)
        except ValueError as e:
            raise QevalError(str(e)) from None
        if precision not in self.precisions:
            raise QevalError(
                f"model '{self.name}' does not build '{precision}'; its card lists: {', '.join(self.precisions)}"
            )


def parse_card(path: Path) -> ModelCard:
    """Read and validate one card file; QevalError with one line on any problem."""
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeys)  # a SafeLoader
    except RecursionError:
        raise QevalError(f"{path}: nested too deeply to be a model card") from None
    except OSError as e:
        raise QevalError(f"{path}: cannot read model card: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise QevalError(f"{path}{where}: not valid YAML: {what}") from None
    if not isinstance(data, dict):
        raise QevalError(f"{path}: a model card is a YAML mapping of keys to values")
    try:
        card = ModelCard.model_validate(data)
    except RecursionError:
        raise QevalError(f"{path}: nested too deeply to be a model card") from None
    except ValidationError as e:
        errors = e.errors()
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise QevalError(f"{path}: {describe(errors[0], ModelCard)}{more}") from None
    if card.name != path.stem:
        raise QevalError(f"{path}: key 'name' is '{card.name}' but the file is named '{path.stem}.yaml'")
    return card


def card_names() -> list[str]:
    return sorted(p.stem for p in cards_dir().glob("*.yaml"))


def check_name(name: str) -> str:
    """`name`, if it can be a card's name; nothing else may build a path, an artifacts folder or an
    experiment name (`../x` would reach outside the work folder)."""
    if not re.fullmatch(NAME_PATTERN, name) or ".." in name:
        raise QevalError(
            f"'{name[:80]}' is not a model card name: lower-case letters, digits, '.', '_' and '-', "
            f"starting with a letter or digit (see qeval models)"
        )
    return name


def load_card(name: str) -> ModelCard:
    """The card named `name`; an unknown name lists the known ones."""
    path = cards_dir() / f"{check_name(name)}.yaml"
    if not path.is_file():
        known = card_names()
        raise QevalError(
            f"unknown model '{name}'{suggest(name, known)}; known: {', '.join(known) or 'none'} (add a card as {path})"
        )
    return parse_card(path)
