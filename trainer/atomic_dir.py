"""Directories that appear whole or not at all: checkpoints and weight snapshots.

`write_atomically(final, write)` lets `write` fill a temporary sibling directory, fsyncs every file
and directory in it, renames it to `final` (atomic on POSIX) and fsyncs the parent, so after a crash
`final` either does not exist or is complete and durable. Leftover temporaries are swept on the next
write.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

TMP_PREFIX = ".tmp-"


def write_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f"{TMP_PREFIX}{final.name}-*"):  # a crash mid-write left it behind
        shutil.rmtree(stale, ignore_errors=True)
    tmp = parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    tmp.mkdir()
    write(tmp)
    _fsync_tree(tmp)
    if final.exists():  # the same step written again by a resumed run: the newer write wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(parent)
    return final


def prune(parent: Path, pattern: str, keep: int) -> None:
    """Delete all but the `keep` newest (by name) directories matching `pattern`."""
    found = sorted(Path(parent).glob(pattern))
    for old in found[:max(len(found) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
