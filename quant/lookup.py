"""Lookups by name, for every registry in qeval (precisions, GPUs, lm-eval tasks, card keys, model cards).

An unknown name is one ValueError that suggests the closest known names and lists them all, as
lm-evaluation-harness's registries do.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import TypeVar

V = TypeVar("V")


def suggest(name: str, known: Iterable[str], n: int = 1) -> str:
    """' (did you mean 'x'?)' for close matches (at most `n`), else ''."""
    close = difflib.get_close_matches(name, list(known), n=n, cutoff=0.6)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def lookup(registry: Mapping[str, V], name: str, what: str) -> V:
    """`registry[name]`; a ValueError naming the close matches and the known names otherwise."""
    try:
        return registry[name]
    except KeyError:
        known = list(registry)
        raise ValueError(f"unknown {what} '{name}'{suggest(name, known, 2)}; known: {', '.join(known)}") from None
