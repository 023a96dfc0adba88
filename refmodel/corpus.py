"""Deterministic splits of the King James Bible text into train, calibration and held-out chapters.

The text comes from Debian's `bible-kjv` package (public domain; see refmodel/README.md). A chapter is
the unit of every split, so no held-out verse ever sits in a training window. The held-out and
calibration splits are committed under refmodel/data/ so that the pipeline runs without the package;
only retraining needs it.
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

# Every 20th chapter (offset 7) is held out, every 20th (offset 13) is calibration: about 5% each,
# spread over the whole book rather than one contiguous stretch of it.
_PERIOD, _HELDOUT_OFFSET, _CALIBRATION_OFFSET = 20, 7, 13
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
    """The split a chapter belongs to, by its position in the book."""
    if index % _PERIOD == _HELDOUT_OFFSET:
        return "heldout"
    if index % _PERIOD == _CALIBRATION_OFFSET:
        return "calibration"
    return "train"


def split_chapters(chapters: list[Chapter]) -> dict[str, list[Chapter]]:
    splits: dict[str, list[Chapter]] = {"train": [], "calibration": [], "heldout": []}
    for i, chapter in enumerate(chapters):
        splits[split_of(i)].append(chapter)
    return splits


def write_jsonl(path: Path, chapters: list[Chapter]) -> str:
    """Write chapters as JSON lines ({"id", "text"}); return the file's sha256."""
    body = "".join(json.dumps({"id": c.id, "text": c.text}, ensure_ascii=False) + "\n" for c in chapters)
    path.write_text(body, encoding="utf-8")
    return hashlib.sha256(body.encode()).hexdigest()


def read_jsonl(path: Path) -> list[Chapter]:
    with path.open(encoding="utf-8") as f:
        return [Chapter(**json.loads(line)) for line in f if line.strip()]
