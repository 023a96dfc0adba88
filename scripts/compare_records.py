"""Compare two runs' per-document records, build by build and task by task.

    python scripts/compare_records.py OLD/artifacts/ref-lm NEW/artifacts/ref-lm

Reads lm-eval's `samples_<task>.jsonl` under each build's `evaluate/` folder and matches documents by
lm-eval's `doc_hash`, so that a task cut to a subset (every second item, every third chapter) is compared on
the documents both runs scored. A record is identical when every field but `doc_id` is; otherwise the
largest difference among its numbers (log-likelihoods, bits-per-byte sums) and whether the metrics the record
names (lm-eval's `metrics` field) agree are counted. Prints one Markdown table; exits 1 when a document both
runs scored differs in a metric.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _records(path: Path) -> dict[str, dict]:
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return {r["doc_hash"]: {k: v for k, v in r.items() if k != "doc_id"} for r in rows}


def _numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _numbers(v)]
    return []


def _largest_gap(old: dict, new: dict) -> float:
    a, b = _numbers(old.get("resps")), _numbers(new.get("resps"))
    return max((abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0) if len(a) == len(b) else float("inf")


def compare(old_root: Path, new_root: Path) -> tuple[list[str], int]:
    lines = [
        "| build | task | documents (new) | scored by both | identical | metric differs | largest gap |",
        "|---|---|---|---|---|---|---|",
    ]
    differing = 0
    for new_dir in sorted(new_root.glob("*/evaluate")):
        build = new_dir.parent.name
        for new_file in sorted(new_dir.glob("samples_*.jsonl")):
            old_file = old_root / build / "evaluate" / new_file.name
            if not old_file.exists():
                continue
            old, new = _records(old_file), _records(new_file)
            both = [h for h in new if h in old]
            same = sum(old[h] == new[h] for h in both)
            metric = sum(any(old[h].get(m) != new[h].get(m) for m in new[h].get("metrics", ())) for h in both)
            gap = max((_largest_gap(old[h], new[h]) for h in both), default=0.0)
            differing += metric
            task = new_file.stem.removeprefix("samples_")
            lines.append(f"| {build} | {task} | {len(new)} | {len(both)} | {same} | {metric} | {gap:.3g} |")
    return lines, differing


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(Path(a).is_dir() for a in argv):
        print("usage: compare_records.py OLD_ARTIFACTS/MODEL NEW_ARTIFACTS/MODEL (two folders)", file=sys.stderr)
        return 2
    lines, differing = compare(Path(argv[0]), Path(argv[1]))
    print("\n".join(lines))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
