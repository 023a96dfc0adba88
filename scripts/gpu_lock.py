"""The GPU set-up's locks, resolved for a GPU machine rather than for this one (docs/toolchain.md, "Locks for a GPU").

    python scripts/gpu_lock.py --check    # every `pip install` that `make` runs on a GPU machine resolves there
    python scripts/gpu_lock.py --write    # requirements-vllm-cuda.lock anew, for every Python a GPU machine has

A GPU machine runs Linux on x86-64 with Python 3.11 or 3.12 and takes torch's CUDA build from the index, whose
requirements (triton, the CUDA libraries) this machine's CPU wheel never pulls: a lock frozen or resolved here says
nothing about them. uv resolves each install for that platform from the index's metadata, downloading and
installing no wheel. The installs are read from `make -n HAS_CUDA=1 run`, the commands a GPU machine runs, so the
check follows the Makefile. Exit 0 when every one resolves; 2 with one line per failure otherwise.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
PLATFORM = "x86_64-manylinux_2_28"  # what torch's and vLLM's Linux wheels are built for
PYTHONS = ("3.11", "3.12")  # what the GPU machines qeval targets run (docs/gpu.md)
ENGINE_LOCK = "requirements-vllm-cuda.lock"
HEADER = """\
# The GPU engine environment (.venv-vllm on a machine with an NVIDIA driver): upstream vLLM, torch's CUDA build and
# lm-eval with its RULER extra, whose vllm backend scores every build there. Resolved by uv for Linux x86-64
# (manylinux 2.28) and each Python a GPU machine has ({pythons}), a marker where they differ:
# `python scripts/gpu_lock.py --write`. CI resolves it again (`--check`). The Makefile installs with -c this file.
"""


class LockError(Exception):
    """An install that cannot resolve for the GPU platform, or a lock that leaves a package to chance."""


def planned_installs(repo: Path = REPO) -> dict[str, tuple[list[str], list[str]]]:
    """The `pip install` commands `make` runs on a GPU machine, by interpreter: (requirements, constraint files)."""
    done = subprocess.run(
        ["make", "-n", "-B", "HAS_CUDA=1", "run"], cwd=repo, capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise LockError(f"make -n HAS_CUDA=1 run failed: {done.stderr.strip()[-300:]}")
    plan: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for words in _commands(done.stdout):
        if "pip" not in words or "install" not in words or "--upgrade" in words:
            continue
        python = words[0]
        wants, constraints = plan[python]
        rest = iter(words[words.index("install") + 1 :])
        for word in rest:
            if word in ("-c", "--constraint"):
                constraints.append(next(rest))
            elif word in ("-e", "--editable"):
                wants.append(f"-e {repo / next(rest)}")
            elif not word.startswith("-"):
                wants.append(word)
    return {py: (list(dict.fromkeys(w)), list(dict.fromkeys(c))) for py, (w, c) in plan.items()}


def _commands(script: str) -> list[list[str]]:
    """Each simple command of a shell script, as its words (a line's `a || b` is two)."""
    commands = []
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("||", "&&", ";", "|", "&"):
                if words:
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands


def resolve(wants: list[str], constraints: list[Path], python: str) -> dict[str, str]:
    """What uv resolves `wants` to under `constraints` for Linux x86-64 and `python`: {name: version}."""
    with tempfile.TemporaryDirectory() as tmp:
        request = Path(tmp) / "request.in"
        request.write_text("\n".join(wants) + "\n")
        args = ["--python-platform", PLATFORM, "--python-version", python, "--no-header", "--no-annotate", "--quiet"]
        for c in constraints:
            args += ["-c", str(c)]
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}  # resolving needs no interpreter of that version
        done = subprocess.run(
            [sys.executable, "-m", "uv", "pip", "compile", *args, str(request)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            check=False,
        )
    if done.returncode != 0:
        why = " ".join(line.strip() for line in done.stderr.splitlines() if line.strip() and "warning" not in line)
        raise LockError(f"{' '.join(wants)} does not resolve for Python {python} on {PLATFORM}: {why[:600]}")
    return _pins(done.stdout, python)


def _pins(text: str, python: str) -> dict[str, str]:
    """A requirements file's exact pins that apply to Linux x86-64 with `python`."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux"}
    env |= {"platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def check(repo: Path = REPO) -> list[str]:
    """One line per planned install that does not resolve for a GPU machine, and per package the engine's lock
    leaves unpinned there (pip would choose its version on the day)."""
    problems = []
    for python_bin, (wants, constraints) in planned_installs(repo).items():
        files = [repo / c for c in constraints]
        for python in PYTHONS:
            try:
                resolved = resolve(wants, files, python)
            except LockError as e:
                problems.append(f"{python_bin}: {e}")
                continue
            if ENGINE_LOCK in constraints:
                locked = _pins((repo / ENGINE_LOCK).read_text(), python)
                if loose := sorted(set(resolved) - set(locked)):
                    problems.append(
                        f"{python_bin}: {ENGINE_LOCK} pins no version of {', '.join(loose)} for Python {python}; "
                        f"write it again: python scripts/gpu_lock.py --write"
                    )
    return problems


def write(repo: Path = REPO) -> Path:
    """requirements-vllm-cuda.lock resolved anew for each Python in PYTHONS, the requested packages held at the
    versions the lock had (vLLM's, torch's and lm-eval's own pins move only by hand)."""
    wants = [want for reqs, locks in planned_installs(repo).values() if ENGINE_LOCK in locks for want in reqs]
    lock = repo / ENGINE_LOCK
    old = _pins(lock.read_text(), PYTHONS[-1]) if lock.is_file() else {}
    held = [f"{n}=={old[n]}" for n in (canonicalize_name(Requirement(w).name) for w in wants) if n in old]
    with tempfile.TemporaryDirectory() as tmp:
        hold = Path(tmp) / "held.txt"
        hold.write_text("\n".join(held) + "\n")
        by_python = {python: resolve(wants, [hold], python) for python in PYTHONS}
    lines = []
    for name in sorted(set().union(*by_python.values())):
        versions = {p: pins.get(name) for p, pins in by_python.items()}
        if len(set(versions.values())) == 1:
            lines.append(f"{name}=={versions[PYTHONS[0]]}")
            continue
        for python, version in versions.items():
            if version is not None:
                lines.append(f'{name}=={version} ; python_version == "{python}"')
    lock.write_text(HEADER.format(pythons=", ".join(PYTHONS)) + "\n".join(lines) + "\n")
    return lock


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="resolve every GPU install; exit 2 where one cannot")
    mode.add_argument("--write", action="store_true", help=f"write {ENGINE_LOCK} anew")
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose Makefile and locks are read")
    args = p.parse_args()
    try:
        if args.write:
            print(f"wrote {write(args.repo)}")
            return 0
        problems = check(args.repo)
    except LockError as e:
        print(f"gpu_lock: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"gpu_lock: {line}", file=sys.stderr)
    if not problems:
        print(f"every GPU install resolves for Python {' and '.join(PYTHONS)} on {PLATFORM}")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
