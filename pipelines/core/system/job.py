"""The work of one child (pipelines/core/system/child.py, or a fork of pipelines/core/system/warm.py): run a
library function on its config file, and write its result (result.json), or its error in one line (error.json, with the
traceback in traceback.txt for the log)."""

from __future__ import annotations

import importlib
import json
import traceback
from pathlib import Path
from typing import get_type_hints


def main(argv: list[str]) -> int:
    """Run `module:function` on the config file into the output folder (argv); 0, or 2 with error.json."""
    target, cfg_path, out_dir = argv[0], Path(argv[1]), Path(argv[2])
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    hints = get_type_hints(fn)
    config_type = next(iter(hints.values()))
    try:
        result = fn(config_type.model_validate_json(cfg_path.read_text()), out_dir)
    except Exception as e:  # reported to the parent as one line; the traceback goes to the log only
        (out_dir / "traceback.txt").write_text(traceback.format_exc())
        (out_dir / "error.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 2
    (out_dir / "result.json").write_text(result.model_dump_json(indent=2))
    return 0
