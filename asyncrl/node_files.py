"""Checkpoint directories carried to nodes that do not share the disk they were written on.

On a cluster without a shared filesystem (cluster.shared_fs false), the initial weights the launcher
wrote (a random init, the warm-up) are put in Ray's object store once, and each engine or trainer
actor whose node lacks the directory unpacks it there, at the same path; a restarting engine fetches
the newest weight snapshot from the trainer actor the same way. The reference is passed wrapped in a
list so Ray hands it over unresolved: a node that has the directory never pulls the bytes.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from asyncrl.network import node_ip

log = logging.getLogger("asyncrl.node_files")

Packed = dict[str, bytes]
"""A directory's files by path relative to it."""


def pack_dir(path: str | Path) -> Packed:
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} is not a checkpoint directory (no config.json)")
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def unpack_dir(files: Packed, path: str | Path) -> None:
    """Write `files` to `path` atomically (a sibling temp dir renamed into place): a crash leaves no half copy."""
    root = Path(path)
    tmp = root.with_name(f".{root.name}.unpacking-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for rel, data in files.items():
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    try:
        tmp.rename(root)
    except OSError:  # another actor on this node unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (root / "config.json").is_file():
            raise


def ensure_dir(path: str, shipped: Optional[list[Any]]) -> None:
    """Make checkpoint directory `path` exist on this node: as it is when it already does, else unpacked from
    `shipped` ([ObjectRef of pack_dir]; None: nothing was shipped, the path is left to whoever reads it)."""
    if not shipped or (Path(path) / "config.json").is_file():
        return
    import ray

    unpack_dir(ray.get(shipped[0]), path)
    log.info("unpacked checkpoint %s on node %s (shipped through Ray's object store)", path, node_ip())
