"""A card's validation error as the one line qeval prints: the key, what is expected, and the wrong value
described rather than echoed (pipelines/core/card/cards.py's parse_card), and the YAML loader that refuses a
key given twice."""

from __future__ import annotations

import re

import yaml
from pydantic import BaseModel

from pipelines.core.card.names import looks_secret
from quant.lookup import suggest


def describe(err: dict, model: type[BaseModel]) -> str:
    """One pydantic error as 'key ...: what is expected'."""
    loc = [_part(x) for x in err["loc"]]
    key = ".".join(loc) or "(card)"
    if err["type"] == "extra_forbidden":
        allowed = _fields_at(model, loc[:-1])
        return f"unknown key '{key}'{suggest(loc[-1], allowed)}; allowed here: {', '.join(allowed)}"
    if err["type"] == "missing":
        return f"missing key '{key}'"
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:
        return msg
    return f"key '{key}': {msg} (got {_shown(err.get('input'))})"


def _part(part: object) -> str:
    """One step of a key's path as an error shows it: a name, or a key the card gave described by its length."""
    text = str(part)
    if isinstance(part, int) or (re.fullmatch(r"[A-Za-z0-9_.\-\[\]]{1,64}", text) and not looks_secret(text)):
        return text
    return f"<a key of {len(text)} characters>"


def _shown(value: object) -> str:
    """A wrong value as an error shows it: numbers and switches as they are, text by its length only (a
    token typed into the wrong key must not reach a terminal or a CI log)."""
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return f"a {type(value).__name__}"


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        inner = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)


class UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool) and key is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key is a {type(key).__name__}, not a name", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
