"""What a card's grid asks of the model and of this machine, checked before a stage starts: its lengths
against the model's positions (`qeval models` says so too), the engine bench's memory against what this
machine has free, and the server sweep's connections against the open-file limit. Refused up front, in
one line with the figures, instead of failing (or swapping) minutes in; and survey(), what `qeval models`
lists and finds wrong.
"""

from __future__ import annotations

import importlib.util
import re
import resource
from functools import cache
from pathlib import Path

import yaml

from eval.devices.sizing import Shape, workspace_bytes
from pipelines.core.card.cards import ModelCard, card_names, load_card
from pipelines.core.framework.weights import architecture, missing_files
from pipelines.core.system.errors import QevalError
from pipelines.core.system.paths import resolve_repo_path
from quant.lookup import suggest

FREE_SHARE = 0.8  # of this machine's available memory, what one bench may plan to use
SPARE_FILES = 64  # open files the load generator's process needs beside its connections


def length_problems(card: ModelCard) -> list[str]:
    """One line per grid length the model cannot hold (none where its positions are not known)."""
    try:
        _, path, positions = architecture(card, "checking the grid's lengths")
    except QevalError:
        return []  # a missing or unreadable config is said where it is needed
    if not positions:
        return []
    s, problems = card.speed, []
    longest = max(s.input_lengths) + max(s.output_lengths)
    if longest > positions:
        problems.append(
            f"model '{card.name}': speed.input_lengths and output_lengths reach {longest:,} tokens, "
            f"and the model has {positions:,} positions ({path}); shorten the longest"
        )
    problems += [
        f"model '{card.name}': scenario '{name}' asks for {sc.output_len:,} output tokens, and the model has "
        f"{positions:,} positions; shorten its output_len"
        for name, sc in s.operating_points.items()
        if sc.output_len >= positions
    ]
    return problems


def available_bytes() -> int | None:
    """This machine's available memory (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kb * 1024


def bench_bytes(shape: Shape, batch: int, input_len: int, output_len: int) -> float:
    """What the grid's largest point holds beside the weights (eval/devices/sizing.py's figures): its KV cache at 16
    bits, and the prefill's activation workspace for every prompt token of the batch (generate() runs the
    prefill unchunked)."""
    return batch * (input_len + output_len) * shape.kv_bytes_per_token(2) + workspace_bytes(shape, batch * input_len)


def check_bench(card: ModelCard, *, in_host_memory: bool) -> None:
    """QevalError where the engine bench's grid cannot hold the model's lengths, or (`in_host_memory`: it runs
    on the CPU) this machine's memory."""
    if problems := length_problems(card):
        raise QevalError(problems[0])
    if not in_host_memory:
        return  # a GPU's memory is the size stage's to judge (qeval size)
    try:
        shape, _, _ = architecture(card, "the engine bench")
    except QevalError:
        return
    s = card.speed
    need = bench_bytes(shape, max(s.batch_sizes), max(s.input_lengths), max(s.output_lengths))
    free = available_bytes()
    if free is not None and need > FREE_SHARE * free:
        raise QevalError(
            f"model '{card.name}': the bench's largest point (batch {max(s.batch_sizes):,}, {max(s.input_lengths):,} + "
            f"{max(s.output_lengths):,} tokens) needs about {_size(need)} beside the weights, and this machine "
            f"has {_size(free)} available; lower speed.batch_sizes or the lengths (qeval size says what fits)"
        )


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def check_sweep(card: ModelCard) -> None:
    """QevalError where the sweep's highest concurrency needs more connections than this process may open."""
    users = max(card.speed.concurrency)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and users + SPARE_FILES > soft:
        raise QevalError(
            f"model '{card.name}': speed.concurrency reaches {users:,} users, one connection each, and this process "
            f"may open {soft:,} files; raise the limit (ulimit -n {users + SPARE_FILES}) or lower the concurrency"
        )


def survey() -> tuple[list[dict], list[str]]:
    """Every card: the valid ones (name, source, precisions, tasks), and a line per problem of the others."""
    listed, problems = [], []
    for name in card_names():
        try:
            card = load_card(name)
        except QevalError as e:
            problems.append(str(e))
            continue
        if missing := missing_files(card) + length_problems(card) + task_problems(card):
            problems.extend(missing)
            continue
        src = card.source.location
        listed.append({"name": name, "source": src, "precisions": card.precisions, "tasks": card.accuracy.tasks})
    return listed, problems


def _tolerant_loader() -> type:
    """A safe YAML loader that reads lm-eval's tags (`!function utils.x`) as nothing."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return Loader


def _names(doc: object) -> set[str]:
    """The task, group and tag names a task YAML defines."""
    names = set()
    if isinstance(doc, dict):
        for key in ("task", "group", "tag"):
            value = doc.get(key)
            names |= {v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)}
    return names


def local_tasks(card: ModelCard) -> tuple[set[str], list[str]]:
    """The names the card's include_path defines, and one line per file there that is not valid YAML
    (lm-eval reads them all, even those the card does not use, and names none in its error)."""
    if not card.accuracy.include_path:
        return set(), []
    names: set[str] = set()
    problems = []
    for path in sorted(resolve_repo_path(card.accuracy.include_path).rglob("*.yaml")):
        try:
            names |= _names(yaml.load(path.read_text(), Loader=_tolerant_loader()))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            problems.append(
                f"model '{card.name}': {path}{where} (in accuracy.include_path) is not valid YAML: "
                f"{what}; lm-eval reads every file there"
            )
        except (OSError, RecursionError) as e:
            problems.append(f"model '{card.name}': cannot read {path} (in accuracy.include_path): {e}")
    return names, problems


@cache
def lm_eval_tasks() -> frozenset[str]:
    """Every name lm-eval's own task YAMLs define (task, group and tag lines, and the list items under them),
    read as text without importing lm-eval; empty where it is not installed."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        return frozenset()
    pattern = re.compile(r"^\s*(?:(?:task|group|tag):\s*|-\s+)([A-Za-z0-9_.\-]+)\s*$", re.M)
    found = set()
    for path in Path(spec.origin).parent.joinpath("tasks").rglob("*.yaml"):
        found.update(pattern.findall(path.read_text(errors="replace")))
    return frozenset(found)


def task_problems(card: ModelCard) -> list[str]:
    """One line per task YAML of the card's include_path that is not valid, and per task the card names that
    neither it nor lm-eval defines: said when the card is read, not when the stage runs."""
    names, problems = local_tasks(card)
    known = lm_eval_tasks()
    if not known:
        return problems  # no lm-eval here: nothing to look names up in
    for task in dict.fromkeys([*card.accuracy.tasks, *(card.server.served_tasks or [])]):
        if task not in names and task not in known:
            where = f"defined neither in {card.accuracy.include_path} nor in" if card.accuracy.include_path else "not"
            problems.append(
                f"model '{card.name}': accuracy task '{task}' is {where} one of lm-eval's tasks"
                f"{suggest(task, names | known)}"
            )
    return problems


def check_tasks(card: ModelCard) -> None:
    if problems := task_problems(card):
        raise QevalError(problems[0])
