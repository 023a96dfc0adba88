"""scripts/compare_records.py: two runs' per-document records matched by document, on records written by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from helpers import REPO

spec = importlib.util.spec_from_file_location("compare_records", REPO / "scripts" / "compare_records.py")
compare_records = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_records)


def _write(root: Path, build: str, task: str, rows: list[dict]) -> None:
    folder = root / build / "evaluate"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(doc_id: int, doc_hash: str, ll: float, acc: float) -> dict:
    return {"doc_id": doc_id, "doc_hash": doc_hash, "resps": [[[ll, False]]], "metrics": ["acc"], "acc": acc}


def test_a_subset_is_matched_by_document_and_a_flip_is_counted(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    _write(old, "fp8", "refkjv_x", [_row(0, "a", -1.0, 1.0), _row(1, "b", -2.0, 0.0), _row(2, "c", -3.0, 1.0)])
    # the new task keeps every second document (its doc_ids renumbered): "a" identical, "c" moved and flipped
    _write(new, "fp8", "refkjv_x", [_row(0, "a", -1.0, 1.0), _row(1, "c", -3.25, 0.0)])
    lines, differing = compare_records.compare(old, new)
    assert lines[-1] == "| fp8 | refkjv_x | 2 | 2 | 1 | 1 | 0.25 |"
    assert differing == 1
    assert compare_records.main([str(old), str(new)]) == 1
    assert compare_records.main([str(old), str(old)]) == 0
    assert compare_records.main([str(old)]) == 2
