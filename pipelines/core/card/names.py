"""The names a card gives (precisions, GPUs, devices, tasks), checked where the card is read.

A name is printed back in many places (progress lines, errors, the report, MLflow), so it is checked once, at its
key: a precision or a GPU must be one qeval knows, a task name must look like one. A wrong value's error says what
is expected and never repeats the value (pipelines/core/card/card_errors.py shows it by its length), so a token
pasted into the wrong key, or an escape sequence, reaches no terminal or log.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from eval.devices.gpus import BY_NAME
from quant.lookup import suggest
from quant.precisions import KV_VARIANTS, MIX_FORM, PRECISIONS, get_precision

CPU = "cpu"
"""The device name of a CPU machine (traffic.prices, gate.cost_on), the device the sweeps run on where there is
no GPU."""

TASK_FORM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")
"""lm-eval task names: letters, digits, '_', '.', '-' (its registry's, and those of the repository's tasks)."""

SECRET_FORM = re.compile(r"(hf|sk|ghp|gho|ghu|ghs|ghr|github_pat|glpat|xox[abpr]|AKIA|eyJ)[-_]?[A-Za-z0-9]", re.I)
"""Prefixes of the access tokens people paste (Hugging Face, OpenAI, GitHub, GitLab, Slack, AWS, JWT)."""


def looks_secret(text: str) -> bool:
    """Whether `text` looks like an access token: a known token prefix followed by a long run, or a long run of
    mixed-case letters and digits with no word in it."""
    long_run = len(text) >= 24 and not re.search(r"[_.\-]", text)
    mixed = bool(re.search(r"[a-z]", text) and re.search(r"[A-Z]", text) and re.search(r"[0-9]", text))
    return (bool(SECRET_FORM.match(text)) and len(text) >= 20) or (long_run and mixed)


def _precision(name: str) -> str:
    try:
        get_precision(name)
    except ValueError:
        if MIX_FORM.fullmatch(name):  # letters, digits, '+' and 'x': the reason may name it
            raise
        known = [*PRECISIONS, *(f"{p}+{kv}" for p in PRECISIONS for kv in KV_VARIANTS)]
        shown = suggest(name, known) if name.isprintable() and not looks_secret(name) else ""
        raise ValueError(
            f"not a precision qeval builds{shown}; known: {', '.join(PRECISIONS)}, a KV-cache variant "
            f"(<precision>+{'|'.join(KV_VARIANTS)}) or a mixed build such as gptq+3xint8"
        ) from None
    return name


def _gpu(name: str) -> str:
    if name not in BY_NAME:
        shown = suggest(name, BY_NAME) if name.isprintable() and not looks_secret(name) else ""
        raise ValueError(f"not a GPU in the catalog{shown}; known: {', '.join(BY_NAME)}")
    return name


def _device(name: str) -> str:
    return name if name == CPU else _gpu(name)


def _task(name: str) -> str:
    if not TASK_FORM.fullmatch(name) or looks_secret(name):
        raise ValueError("not a task name: letters, digits, '_', '.' and '-', at most 100, as lm-eval names tasks")
    return name


PrecisionName = Annotated[str, AfterValidator(_precision)]
GpuName = Annotated[str, AfterValidator(_gpu)]
DeviceName = Annotated[str, AfterValidator(_device)]
"""A GPU of the catalog, or 'cpu'."""
TaskName = Annotated[str, AfterValidator(_task)]
