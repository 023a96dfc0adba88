"""`qeval init`: a model card written from a model's config.json, validated before it is saved.

From a local checkpoint folder (the card points at it) or a hub id (its config.json, from the hub's local
cache or the hub, is shipped as pipelines/models/configs/<name>.json, so that the speed half runs without the weights).
Everything the config does not say is guessed and each guess is reported: the usual precisions (4-bit at the
largest group size that divides every quantized layer's input width), a calibration set for hub models, a
grid and an objective that fit the model's context, and placeholder accuracy tasks the user edits.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eval.devices.sizing import Shape, positive_int
from pipelines.core.card.cards import parse_card
from pipelines.core.system.errors import QevalError
from pipelines.core.system.files import atomic_write
from pipelines.core.system.paths import REPO_ROOT, cards_dir, shown_path
from quant.recipes import GROUP_SIZE

CONFIGS = REPO_ROOT / "pipelines" / "models" / "configs"  # architectures beside the cards that name them


def _scalar(value: str) -> str:
    """`value` as one double-quoted YAML scalar on one line: a path or a name read from outside (a folder
    named `m #x`, an architecture name holding a newline) stays that value and nothing more."""
    return yaml.safe_dump(value, default_style='"', allow_unicode=True, width=math.inf).strip()


NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
PLACEHOLDER_TASKS = ["arc_easy", "hellaswag"]
MIN_CONTEXT = 16  # the grid takes a quarter for the prompt and an eighth for the output: 2 tokens, a TPOT


@dataclass
class Scaffold:
    """The card's text, where it goes, and what was guessed."""

    name: str
    text: str
    config: dict
    guesses: list[str] = field(default_factory=list)
    shipped_config: Path | None = None  # pipelines/models/configs/<name>.json, for a hub model


def card_name(source: str) -> str:
    """A card name from a hub id or folder: its last part, lower case (Qwen/Qwen2.5-0.5B -> qwen2.5-0.5b)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", Path(source.rstrip("/")).name.lower()).strip("-.")
    if not NAME.match(name):
        raise QevalError(f"cannot make a card name from '{source}'; give one with --name (a-z, 0-9, '.', '_', '-')")
    return name


def read_config(source: str, revision: str) -> tuple[dict, Path | None]:
    """The model's config.json, and the local folder it came from (None: the hub's)."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        if not path.is_file():
            raise QevalError(f"{folder} has no config.json; point qeval init at a checkpoint folder or a hub id")
        return _json(path), folder.resolve()
    if source.count("/") != 1:
        raise QevalError(f"'{source}' is neither a folder nor a hub id (owner/name)")
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(source, "config.json", revision=revision)
    except Exception as e:  # offline, gated, unknown: one line, the fix
        raise QevalError(
            f"cannot read {source}'s config.json ({type(e).__name__}); download the model where the "
            f"hub is reachable and point qeval init at its folder"
        ) from None
    return _json(Path(path)), None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise QevalError(f"{path}: not a readable config.json ({e})") from None
    if not isinstance(data, dict):
        raise QevalError(f"{path}: a config.json is a JSON object")
    return data


def group_size(shape: Shape) -> int:
    """The largest group size up to the default that divides every quantized layer's input width."""
    widths = [shape.hidden, shape.intermediate, shape.heads * shape.head_dim]
    return math.gcd(GROUP_SIZE, *widths)


def scaffold(source: str, *, name: str | None = None, revision: str = "main") -> Scaffold:
    """The card for `source` (a folder or a hub id), validated; nothing is written."""
    config, folder = read_config(source, revision)
    name = name or card_name(source)
    if not NAME.match(name):
        raise QevalError(f"--name '{name}': a card name is a-z, 0-9, '.', '_' and '-', starting with a letter or digit")
    try:
        shape = Shape.from_config(config)
    except (KeyError, ValueError, TypeError) as e:
        raise QevalError(f"{source}: its config.json is not a decoder-only transformer qeval can size ({e})") from None
    try:
        context = positive_int(config, "max_position_embeddings", 2048)
    except ValueError as e:
        raise QevalError(f"{source}: {e}") from None
    if context < MIN_CONTEXT:
        raise QevalError(
            f"{source}: max_position_embeddings is {context}; qeval makes cards for a context of "
            f"{MIN_CONTEXT} positions or more (a speed grid of at least 2 output tokens)"
        )
    guesses = []
    group = group_size(shape)
    precisions = ["bf16", "fp8", "int8", "awq", "gptq"] if group >= 32 else ["bf16", "fp8", "int8"]
    if group < 32:
        guesses.append(f"no 4-bit builds: no group size of 32 or more divides the layer widths (gcd {group})")
    elif group != GROUP_SIZE:
        guesses.append(f"4-bit group size {group}: {GROUP_SIZE} does not divide every quantized layer's input width")
    input_len, output_len = min(512, context // 4), min(128, context // 8)
    guesses.append(
        f"speed grid {input_len} tokens in, {output_len} out, 1 to 16 users, within the {context}-position "
        f"context; objective TTFT p95 2 s, TPOT p95 50 ms (interactive chat): edit speed:"
    )
    guesses.append(f"accuracy tasks {', '.join(PLACEHOLDER_TASKS)} are placeholders: edit accuracy.tasks")
    shipped = None
    if folder is not None:
        where = shown_path(folder)
        source_lines = f"  path: {_scalar(str(where))}"
    else:
        shipped = CONFIGS / f"{name}.json"
        source_lines = "\n".join(
            [
                f"  hub_id: {_scalar(source)}",
                f"  revision: {_scalar(revision)}   # pin a commit hash for reproducible builds",
                f"  config: {_scalar(str(shown_path(shipped)))}   # the architecture: the speed half needs no weights",
            ]
        )
        guesses.append("calibration from HuggingFaceH4/ultrachat_200k (256 prompts): edit calibration: for your domain")
    calibration = (
        "calibration:\n  dataset: HuggingFaceH4/ultrachat_200k\n  split: train_sft\n  text_field: prompt\n"
        f"  num_samples: 256\n  max_seq_length: {min(2048, context)}\n"
    )
    size = f"{shape.layers} layers, hidden {shape.hidden}, vocabulary {shape.vocab:,}"
    described = f"{(config.get('architectures') or ['model'])[0]} from {source} ({size})"
    text = f"""# Written by `qeval init {_scalar(source)}`; every guess is marked. Check it with `qeval models`.
name: {name}
description: {_scalar(described)}
source:
{source_lines}
precisions: [{", ".join(precisions)}]
{calibration}quantization:
  group_size: {group}
accuracy:
  # placeholders (guessed): the tasks your users care about, lm-eval names
  tasks: [{", ".join(PLACEHOLDER_TASKS)}]
  batch_size: 16
speed:
  # guessed: fits the model's {context} positions
  batch_sizes: [1, 8]
  input_lengths: [{input_len}]
  output_lengths: [{output_len}]
  concurrency: [1, 4, 16]
  slo:
    ttft_ms: 2000
    tpot_ms: 50
server:
  max_model_len: {min(context, 8192)}
target_gpus: [h100-sxm, l4]
gate:
  baseline: bf16
  min_recovery: 0.99
  speed_regime: server
"""
    return Scaffold(name=name, text=text, config=config, guesses=guesses, shipped_config=shipped)


def write(s: Scaffold, *, force: bool = False) -> Path:
    """The card (and a hub model's config) saved once the card parses; an existing card, or another config at the
    config's place (a card elsewhere may name it), needs `force`."""
    path = cards_dir() / f"{s.name}.yaml"
    if path.exists() and not force:
        raise QevalError(f"{path} exists; pass --force to replace it, or --name for another card")
    config = s.shipped_config
    if config is not None and config.exists() and not force and _json_or_none(config) != s.config:
        raise QevalError(f"{config} exists with another architecture; pass --force to replace it, or --name")
    with tempfile.TemporaryDirectory() as tmp:  # parsed where it cannot replace anything first
        trial = Path(tmp) / path.name
        trial.write_text(s.text)
        try:
            parse_card(trial)
        except QevalError as e:
            raise QevalError(f"qeval init made a card that does not validate ({e}); this is a qeval bug") from None
    if s.shipped_config is not None:
        s.shipped_config.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(s.shipped_config, json.dumps(s.config, indent=2) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, s.text)
    return path


def _json_or_none(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
