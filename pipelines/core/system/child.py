"""Run one library function in a fresh Python process, so that each build's work is isolated.

    python -m pipelines.core.system.child eval.quality.accuracy:evaluate_accuracy CONFIG.json OUT_DIR

The function takes (config, out_dir) and returns a pydantic model. The child writes result.json, or
error.json with one line, into OUT_DIR; its output (third-party progress bars and warnings among it)
goes to the stage's log file, and to the parent's stderr only with `qeval --verbose`; its latest line
is the step that qeval's progress lines report (pipelines/core/system/progress.py).
A fresh process per build keeps one build's weights, kernels and memory peak out of another's figures; where
pipelines/core/system/warm.py can, that process is forked from a Python that has imported the job's libraries once.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar, get_type_hints

from pydantic import BaseModel

from pipelines.core.system import job, progress, warm
from pipelines.core.system.errors import QevalError
from pipelines.core.system.paths import REPO_ROOT

R = TypeVar("R", bound=BaseModel)


class ChildFailed(QevalError):
    """The child reported an error (its one-line message) or died."""


def run_child(
    fn: Callable[[BaseModel, Path], R],
    config: BaseModel,
    out_dir: Path,
    log_file: Path,
    env: dict[str, str] | None = None,
    *,
    python: str | None = None,
) -> R:
    """Run library function `fn` (config, out_dir) -> result on `config` in a child process; its result.

    The function is passed, not its name, so that the stage that calls it imports its module: the stage's
    cache key covers its code (pipelines/core/framework/code.py). `python`: another environment's interpreter to run it
    (the engine's, .venv-vllm, for lm-eval's vllm backend); it imports qeval from the repository it runs in."""
    target = f"{fn.__module__}:{fn.__name__}"
    result_type = get_type_hints(fn)["return"]
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / f"{fn.__name__}_config.json"
    cfg_path.write_text(config.model_dump_json(indent=2))
    for stale in ("result.json", "error.json"):
        (out_dir / stale).unlink(missing_ok=True)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_file, "ab") as log:
        if warm.usable(python) and (forks := warm.take(fn.__module__, child_env)) is not None:
            healthy = False
            try:
                _relay(forks.run(target, cfg_path, out_dir), log)
                healthy = True
            finally:  # interrupted: the warm Python and its job go
                warm.give(forks, healthy=healthy)
            code = forks.code if forks.code is not None else forks.proc.returncode
        else:
            code = _fresh(
                [python or sys.executable, "-m", "pipelines.core.system.child", target, str(cfg_path), str(out_dir)],
                child_env,
                log,
            )
    if (trace := out_dir / "traceback.txt").is_file():
        with open(log_file, "ab") as log:
            log.write(trace.read_bytes())
        trace.unlink()
    if (out_dir / "error.json").is_file():
        raise ChildFailed(json.loads((out_dir / "error.json").read_text())["error"])
    if code != 0 or not (out_dir / "result.json").is_file():
        raise ChildFailed(f"{target} exited with status {code} (killed or out of memory?); log: {log_file}")
    result = result_type.model_validate_json((out_dir / "result.json").read_text())
    (out_dir / "result.json").unlink()
    return result


def _fresh(cmd: list[str], env: dict[str, str], log) -> int:
    """Run `cmd` in a fresh process, its output relayed to `log`; its exit status."""
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    try:
        _relay(iter(lambda: proc.stdout.read1(4096), b""), log)
        return proc.wait()
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): the child goes too
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def _relay(chunks: Iterator[bytes], log) -> None:
    """A child's output to its log file as it comes, its latest line to qeval's progress line, and to stderr
    with `qeval --verbose`."""
    echo = logging.getLogger().isEnabledFor(logging.DEBUG)
    rest = ""
    for chunk in chunks:
        log.write(chunk)
        log.flush()
        text = chunk.decode(errors="replace")
        latest, rest = progress.last_line(rest + text)
        if latest:
            progress.step(latest)
        if echo:
            sys.stderr.write(text)
            sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(job.main(sys.argv[1:]))
