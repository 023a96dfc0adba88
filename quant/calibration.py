"""Calibration text for the precisions that need it: read, cleaned, tokenized, digested.

Empty samples are dropped (an empty text tokenizes to an empty float tensor and fails deep inside
the model, docs/toolchain.md), and so are samples shorter than MIN_TOKENS tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

MIN_TOKENS = 16


@dataclass(frozen=True)
class CalibrationSpec:
    dataset: str
    split: str
    text_field: str
    num_samples: int
    max_seq_length: int


@dataclass(frozen=True)
class CalibrationSet:
    input_ids: list[list[int]]
    sha256: str
    dropped: int
    tokens: int


def read_texts(spec: CalibrationSpec) -> list[str]:
    """All texts of the data set: a local JSONL file or a hub data set."""
    path = Path(spec.dataset)
    if spec.dataset.endswith(".jsonl"):
        if not path.is_file():
            raise ValueError(f"calibration file {path} does not exist (calibration.dataset in the card)")
        rows = _jsonl_rows(path)
    else:
        import datasets

        try:
            rows = datasets.load_dataset(spec.dataset, split=spec.split)
        except Exception as e:  # offline, unknown id, no such split: all say the same to the user
            raise ValueError(
                f"calibration data set {spec.dataset} (split {spec.split}) cannot be loaded: "
                f"{str(e).splitlines()[0]}; point calibration.dataset at a local JSONL file instead"
            ) from None
    texts = []
    for row in rows:
        value = row.get(spec.text_field)
        if value is None:
            raise ValueError(f"calibration data set {spec.dataset} has no field '{spec.text_field}'")
        texts.append(value if isinstance(value, str) else json.dumps(value))
    return texts


def _jsonl_rows(path: Path) -> list[dict]:
    """The objects of a JSONL file; a line that is not a JSON object is an error naming file and line."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: each line must be a JSON object, not a {type(row).__name__}")
        rows.append(row)
    return rows


def prepare(spec: CalibrationSpec, texts: list[str], encode) -> CalibrationSet:
    """The first `num_samples` usable texts, tokenized by `encode` and cut to `max_seq_length`."""
    kept: list[list[int]] = []
    dropped = 0
    for text in texts:
        if len(kept) == spec.num_samples:
            break
        ids = encode(text)[: spec.max_seq_length] if text.strip() else []
        if len(ids) < MIN_TOKENS:
            dropped += 1
            continue
        kept.append(ids)
    if len(kept) < spec.num_samples:
        raise ValueError(
            f"calibration set {spec.dataset} has {len(kept)} usable samples ({dropped} dropped as empty or "
            f"shorter than {MIN_TOKENS} tokens) but calibration.num_samples asks for {spec.num_samples}; "
            f"lower it or supply more text"
        )
    digest = hashlib.sha256(json.dumps(kept).encode()).hexdigest()
    return CalibrationSet(kept, digest, dropped, sum(len(k) for k in kept))
