"""Deterministic splits of the King James Bible text into training and held-out chapters, and the calibration
chapters drawn from the training ones.

    apt-get install -y bible-kjv
    .venv/bin/python -m refmodel.corpus    # rewrites refmodel/data/{heldout,calibration}.jsonl and splits.json

The text comes from Debian's `bible-kjv` package (public domain; see refmodel/README.md). A chapter is
the unit of every split, so no held-out verse ever sits in a training window. The held-out and
calibration chapters are committed under refmodel/data/ so that the pipeline runs without the package;
only retraining and re-splitting need it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
MODEL_DIR = Path(__file__).resolve().parent / "ref-lm"  # the trained checkpoint that ships
HELDOUT_FILE = DATA_DIR / "heldout.jsonl"
CALIBRATION_FILE = DATA_DIR / "calibration.jsonl"
SPLITS_FILE = DATA_DIR / "splits.json"

# Two chapters in every 20 (offsets 7 and 13) are held out, about 10 % spread over the whole book rather than one
# contiguous stretch of it; the model trains on the rest. Calibration (offset 3) is a sample of the training
# chapters, as a calibration set drawn from a model's training distribution is: every chapter the model has not
# read is left to the accuracy tasks, whose pools it bounds (refmodel/README.md, "Splits").
_PERIOD, _HELDOUT_OFFSETS, _CALIBRATION_OFFSET = 20, (7, 13), 3
SPLIT_RULE = "index % 20 in (7, 13) -> heldout, else train; index % 20 == 3 -> calibration (training chapters)"
_HEADER = re.compile(r"^(\S.*\S) (\d+)$")
_VERSE = re.compile(r"^\s+\d+ (.*)$")


@dataclass(frozen=True)
class Chapter:
    """One chapter: its id ("Genesis 1") and its verses, one per line, without verse numbers."""

    id: str
    text: str


def read_kjv() -> str:
    """Return the whole KJV text as printed by Debian's `bible` command."""
    if shutil.which("bible") is None:
        raise RuntimeError("the `bible` command is missing: apt-get install -y bible-kjv")
    out = subprocess.run(["bible", "-l0", "gen1:1-rev22:21"], check=True, capture_output=True, text=True)
    return out.stdout


def parse_chapters(raw: str) -> list[Chapter]:
    """Split the `bible -l0` output into chapters."""
    chapters: list[Chapter] = []
    current: str | None = None
    verses: list[str] = []
    for line in raw.splitlines():
        if header := _HEADER.match(line):
            if current is not None:
                chapters.append(Chapter(current, "\n".join(verses)))
            current, verses = f"{header.group(1)} {header.group(2)}", []
        elif verse := _VERSE.match(line):
            verses.append(verse.group(1).strip())
    if current is not None:
        chapters.append(Chapter(current, "\n".join(verses)))
    return chapters


def split_of(index: int) -> str:
    """The split a chapter belongs to, by its position in the book: held out or trained on."""
    return "heldout" if index % _PERIOD in _HELDOUT_OFFSETS else "train"


def is_calibration(index: int) -> bool:
    """Whether a chapter is in the calibration sample (always one of the training chapters)."""
    return index % _PERIOD == _CALIBRATION_OFFSET


def split_chapters(chapters: list[Chapter]) -> dict[str, list[Chapter]]:
    splits: dict[str, list[Chapter]] = {"train": [], "calibration": [], "heldout": []}
    for i, chapter in enumerate(chapters):
        splits[split_of(i)].append(chapter)
        if is_calibration(i):
            splits["calibration"].append(chapter)
    return splits


def write_splits(chapters: list[Chapter]) -> dict[str, list[Chapter]]:
    """Write the held-out and calibration chapters and splits.json (with each split's sha256); return the splits."""
    splits = split_chapters(chapters)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    digests = {
        "heldout": write_jsonl(HELDOUT_FILE, splits["heldout"]),
        "calibration": write_jsonl(CALIBRATION_FILE, splits["calibration"]),
        "train": hashlib.sha256("\n".join(c.text for c in splits["train"]).encode()).hexdigest(),
    }
    info = {
        "source": "Debian package bible-kjv: bible -l0 gen1:1-rev22:21",
        "unit": "chapter",
        "rule": SPLIT_RULE,
        "chapters": {k: len(v) for k, v in splits.items()},
        "characters": {k: sum(len(c.text) for c in v) for k, v in splits.items()},
        "sha256": digests,
    }
    SPLITS_FILE.write_text(json.dumps(info, indent=2) + "\n")
    return splits


def write_jsonl(path: Path, chapters: list[Chapter]) -> str:
    """Write chapters as JSON lines ({"id", "text"}); return the file's sha256."""
    body = "".join(json.dumps({"id": c.id, "text": c.text}, ensure_ascii=False) + "\n" for c in chapters)
    path.write_text(body, encoding="utf-8")
    return hashlib.sha256(body.encode()).hexdigest()


def read_jsonl(path: Path) -> list[Chapter]:
    with path.open(encoding="utf-8") as f:
        return [Chapter(**json.loads(line)) for line in f if line.strip()]


if __name__ == "__main__":
    print(json.dumps({k: len(v) for k, v in write_splits(parse_chapters(read_kjv())).items()}))
