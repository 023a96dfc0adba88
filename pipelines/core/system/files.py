"""How qeval writes: whole or not at all. Atomic files, folders built beside their place and swapped in,
locks between processes, and content digests.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.core.system.errors import QevalError


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write a file whole or not at all: a temporary file beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def replace_dir(new: Path, final: Path) -> None:
    """Put the finished folder `new` in place of `final`, whose previous contents (and any failed attempt
    kept beside it as `<name>.failed`) go."""
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(final.with_name(f"{final.name}.failed"), ignore_errors=True)


@contextmanager
def scratch(final: Path, what: str) -> Iterator[Path]:
    """An empty folder beside `final` (`.<name>.<what>-<pid>`), for work that replace_dir() or a rename puts
    in place once it is whole; whatever is left of it goes when the block ends, however it ends."""
    folder = final.with_name(f".{final.name}.{what}-{os.getpid()}")
    shutil.rmtree(folder, ignore_errors=True)
    for left in final.parent.glob(f".{final.name}.{what}-*"):  # left by a process that was killed
        pid = left.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    """A process `pid` exists (one of another user's counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def locked(path: Path, what: str = "files") -> Iterator[None]:
    """Hold the file lock `path` (made with its folder where missing) while the block runs; one line
    naming `what` lives there and the fix where it cannot be made."""
    from filelock import FileLock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(path)
        lock.acquire()
    except OSError as e:
        raise QevalError(f"cannot write {what} under {path.parent}: {e.strerror}; set QEVAL_WORKDIR") from None
    try:
        yield
    finally:
        lock.release()


def file_digest(paths: Iterable[Path]) -> str:
    """sha256 over files (and every file under folders), by relative name and content."""
    h = hashlib.sha256()
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()
