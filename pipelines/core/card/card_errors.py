"""A card's validation error as the one line qeval prints: the key, what is expected, and the wrong value
described rather than echoed (pipelines/core/card/cards.py's parse_card), and the YAML loader that refuses a
key given twice."""

from __future__ import annotations

import yaml
from pydantic import BaseModel

from quant.lookup import suggest


def describe(err: dict, model: type[BaseModel]) -> str:
    """One pydantic error as 'key ...: what is expected'."""
    loc = [str(x) for x in err["loc"]]
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
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
