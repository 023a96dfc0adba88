"""lm-eval's tasks as a card names them: found (a local folder's, else lm-eval's own), loaded with their
documents and shots, and their code imported where their data lies on the hub; with eval/quality/accuracy.py, the only
modules that import lm_eval.

check() is what the evaluate stage asks, before any build is made, of the interpreter that will score them (on a
GPU the engine's, .venv-vllm): a task whose code needs a package that interpreter lacks (RULER's wonderwords)
would otherwise fail the baseline's evaluation after every build was quantized. task_files() lists a local task
folder's YAMLs and the data files they name, for the stage's cache key.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Protocol

from quant.lookup import suggest


class TaskSettings(Protocol):
    """What loading tasks reads of an evaluation's settings (eval/quality/accuracy.py, AccuracyConfig)."""

    checkpoint: str
    tasks: list[str]
    include_path: str | None
    num_fewshot: int | dict[str, int] | None
    seed: int
    trust_remote_code: bool
    max_seq_lengths: list[int] | None

    def model_copy(self, *, update: dict[str, Any]) -> TaskSettings: ...


def load_tasks(cfg: TaskSettings) -> tuple[dict[str, list], Any]:
    """lm-eval's Task and Group objects for the evaluation (per task the card names: a tag names several),
    their documents made and their shots set, and the TaskManager that found them; one clear error naming a
    task that is unknown or cannot be loaded.

    Tasks that make their documents when loaded (RULER's niah_*) draw them from Python's and numpy's global
    generators and size them with the model's tokenizer: both are seeded here and the checkpoint is handed to
    them (lm-eval's task metadata), so every build is scored on the same documents. Where every task is in
    the local folder, lm-eval's own task index is not read."""
    import numpy as np

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    manager = _task_manager(cfg)
    shots = cfg.num_fewshot if isinstance(cfg.num_fewshot, dict) else {}
    tasks: dict[str, list] = {}
    for name in cfg.tasks:
        _known(manager, name)
        try:
            loaded = manager.load([name])
        except Exception as e:
            raise ValueError(_cannot_load(name, e)) from None
        top = loaded["groups"][name] if name in loaded["groups"] else loaded["tasks"].get(name)
        tasks[name] = [top] if top is not None else list(loaded["tasks"].values())  # a tag: the tasks it names
        if name in shots:
            for task in loaded["tasks"].values():
                task.set_config(key="num_fewshot", value=shots[name])
    return tasks, manager


def _known(manager, name: str) -> None:
    """ValueError, with the closest names, where `manager` knows no task, group or tag `name`."""
    if name not in manager.all_tasks:
        hint = suggest(name, manager.all_tasks, n=3)
        raise ValueError(f"unknown lm-eval task '{name}'{hint}; list them with `lm-eval ls tasks`")


def _local_manager(cfg: TaskSettings):
    """A TaskManager of the local task folder alone (lm-eval's own index left unread), or None without one."""
    from lm_eval.tasks import TaskManager

    if not cfg.include_path:
        return None
    return TaskManager(include_path=cfg.include_path, include_defaults=False, metadata=_metadata(cfg) or None)


def _metadata(cfg: TaskSettings) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    if cfg.trust_remote_code or not _tokenizer_runs_code(cfg.checkpoint):
        # RULER loads this tokenizer with trust_remote_code=True (lm_eval/tasks/ruler/common_utils.py): handed
        # over only where that runs nothing the card has not trusted
        metadata["pretrained"] = cfg.checkpoint
    if cfg.max_seq_lengths:
        metadata["max_seq_lengths"] = cfg.max_seq_lengths
    return metadata


def _task_manager(cfg: TaskSettings):
    from lm_eval.tasks import TaskManager

    local = _local_manager(cfg)
    if local is not None and all(name in local.all_tasks for name in cfg.tasks):
        return local
    return TaskManager(include_path=cfg.include_path, metadata=_metadata(cfg) or None)


def _tokenizer_runs_code(checkpoint: str) -> bool:
    """The checkpoint's tokenizer is code of its own (`auto_map` in its tokenizer config)."""
    try:
        return "auto_map" in json.loads((Path(checkpoint) / "tokenizer_config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _cannot_load(name: str, e: Exception) -> str:
    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, ModuleNotFoundError):
        return f"task '{name}' needs the Python package '{e.name}', which is not installed here ({why})"
    if offline:
        return (
            f"task '{name}' needs its data set from the hub, which is off here ({why}); where the hub is "
            f"reachable set QEVAL_ALLOW_HUB=1 once to fill the cache, or write a local task YAML with "
            f"dataset_path: json"
        )
    return f"task '{name}' could not be loaded: {why}"


def check(cfg: TaskSettings) -> dict[str, str]:
    """Every task of `cfg` loaded as far as this machine allows, in this interpreter: a task of the local folder
    with its documents made; one of lm-eval's, whose data set comes from the hub when it is first scored, with
    every function and class its YAMLs name imported (a group's and a tag's members too), which is where a missing
    package shows. {task: what was checked}; ValueError, one line, naming the first task that cannot load."""
    local = _local_manager(cfg)
    here = [t for t in cfg.tasks if local is not None and t in local.all_tasks]
    checked = {}
    if here:
        tasks, _ = load_tasks(cfg.model_copy(update={"tasks": here}))
        for name, loaded in tasks.items():
            docs = sum(len(list(t.eval_docs)) for t in loaded if hasattr(t, "eval_docs"))
            checked[name] = f"{docs} documents made"
    rest = [t for t in cfg.tasks if t not in here]
    if rest:
        manager = _task_manager(cfg.model_copy(update={"tasks": rest}))
        for name in rest:
            _known(manager, name)
            try:
                n = _import_task_code(manager.task_index, name, set())
            except Exception as e:
                raise ValueError(_cannot_load(name, e)) from None
            checked[name] = f"{n} task files' code imported; its data set comes from the hub when first scored"
    return checked


def _import_task_code(index: dict, name: str, seen: set[str]) -> int:
    """Import what the YAML of `name` and of its members names (`!function`, `class`); the YAML files read."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    if name in seen or (entry := index.get(name)) is None:
        return 0  # read already, or a member defined inline in its group's YAML (read with it)
    seen.add(name)
    config = load_yaml(entry.yaml_path, resolve_func=True, recursive=True) if entry.yaml_path else entry.cfg or {}
    if entry.kind is Kind.TAG:
        members = [n for n, e in index.items() if name in e.tags]
    else:
        listed = config.get("task")
        members = listed if isinstance(listed, list) else []
    read = 1 if entry.yaml_path else 0
    for member in members:
        member = member if isinstance(member, str) else member.get("task") or member.get("group")
        if isinstance(member, str):
            read += _import_task_code(index, member, seen)
    return read


def task_files(include: Path, root: Path) -> list[Path]:
    """A local task folder's YAMLs, the Python files beside them (a YAML's `!function` names one: its
    scoring) and the data files they name (relative to `root`, where lm-eval runs), so that editing any
    reruns a stage."""
    import yaml

    class _TaskYamlLoader(yaml.SafeLoader):
        """Reads task YAMLs, whose `!function` tags name Python code not needed here."""

    _TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
    files = sorted(include.glob("*.yaml"))
    for f in list(files):
        spec = yaml.load(f.read_text(), Loader=_TaskYamlLoader) or {}
        data_files = (spec.get("dataset_kwargs") or {}).get("data_files") or {}
        for value in data_files.values() if isinstance(data_files, dict) else [data_files]:
            path = Path(value) if isinstance(value, str) else None
            if path is not None and not path.is_absolute():
                path = root / path
            if path is not None and path.is_file():
                files.append(path)
    return files + sorted(include.glob("*.py"))
