"""What a checkpoint is, byte for byte: every file's sha256, recorded when the quantize stage makes it and
checked before anything uses, ships or delivers it; and weight files that are what they claim to be.

A safetensors file is an 8-byte little-endian header length, a JSON header whose tensors' `data_offsets`
end where the data ends, then the data (https://github.com/huggingface/safetensors, "Format"): a file
whose size is not 8 + header + data is truncated or padded, and is refused before a loader reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from pipelines.core.system.errors import QevalError

MAX_HEADER = 100_000_000  # the safetensors crate's own limit on a header's length


class Tampered(QevalError):
    """A file differs from what was recorded when it was made."""


def regular(path: Path) -> os.stat_result:
    """The file's status, if it is (or links to) a regular file; a device, FIFO or socket would be read
    forever or block, so it is refused in one line."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise QevalError(f"cannot read {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        target = f" (it points at {os.path.realpath(path)})" if path.is_symlink() else ""
        raise QevalError(f"{path} is not a regular file{target}; weights must be files: replace it with the file")
    return st


def sha256(path: Path) -> str:
    regular(path)
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: Path) -> dict[str, str]:
    """Relative name -> sha256 of every file under `folder`."""
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if not p.is_dir()}


def hashes_digest(hashes: Mapping[str, str]) -> str:
    """One sha256 over a folder's file list, for a place that holds one value (a registry tag)."""
    return hashlib.sha256(json.dumps(dict(hashes), sort_keys=True).encode()).hexdigest()


def differences(folder: Path, recorded: Mapping[str, str], extra_ok: tuple[str, ...] = ()) -> list[str]:
    """What in `folder` is not as recorded, one phrase per file (missing, changed, added); empty when whole."""
    found: list[str] = []
    here = {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()} if folder.is_dir() else set()
    for name, digest in sorted(recorded.items()):
        if name not in here:
            found.append(f"{name} is missing")
        elif sha256(folder / name) != digest:
            found.append(f"{name} has changed (sha256 differs from the recorded one)")
    found += [f"{name} was added" for name in sorted(here - set(recorded) - set(extra_ok))]
    return found


def check_folder(
    folder: Path, recorded: Mapping[str, str], what: str, fix: str, extra_ok: tuple[str, ...] = ()
) -> None:
    """Tampered naming the first file that is not as recorded, what it is and the fix; nothing when whole."""
    if problems := differences(folder, recorded, extra_ok):
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise Tampered(f"{what}: {folder}/{problems[0]}{more}; {fix}")


def check_safetensors(path: Path) -> None:
    """QevalError naming the file when it is not a regular file whose header accounts for its size."""
    size = regular(path).st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(MAX_HEADER, size - 8):
            raise QevalError(
                f"{path} is not a whole safetensors file ({size:,} bytes, no readable header): "
                f"truncated or not weights; copy it again"
            )
        try:
            header = json.loads(fh.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise QevalError(f"{path} has a safetensors header that cannot be read; copy it again") from None
    if 8 + n + end != size:
        raise QevalError(
            f"{path} is {size:,} bytes but its safetensors header accounts for {8 + n + end:,}: "
            f"{'truncated' if size < 8 + n + end else 'not as written'}; copy it again"
        )
