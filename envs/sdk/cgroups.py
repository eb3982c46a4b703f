"""Per-episode pids and memory cgroups, created under the service's own cgroup where it may write.

rlimits bound each process; a cgroup bounds the episode as a whole (a hundred processes of 500 MB
each would pass RLIMIT_AS). Both cgroup v1 controllers and the v2 unified tree are handled; where
neither is writable (containers, non-root) the sandbox relies on rlimits alone and says so at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("envs.sandbox")

# controller -> (v1 limit files, v2 limit files); values written in order
_LIMIT_FILES = {
    "pids": (("pids.max",), ("pids.max",)),
    "memory": (("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"), ("memory.max", "memory.swap.max")),
}


@dataclass(frozen=True)
class _Hierarchy:
    controller: str
    parent: Path
    """The service's own cgroup directory for this controller."""
    version: int


def find_hierarchies() -> list[_Hierarchy]:
    """The writable pids/memory hierarchies the service itself sits in ([] where there are none)."""
    mounts = [line.split()[1:4] for line in _read(Path("/proc/self/mounts")).splitlines()]
    own = [line.split(":", 2) for line in _read(Path("/proc/self/cgroup")).splitlines()]
    found = []
    for controller in _LIMIT_FILES:
        for mountpoint, fstype, options in mounts:
            if fstype == "cgroup" and controller in options.split(","):
                path = next((p for _, names, p in own if controller in names.split(",")), None)
                found += [_Hierarchy(controller, Path(mountpoint + path), 1)] if path else []
            elif fstype == "cgroup2":
                path = next((p for h, _, p in own if h == "0"), None)
                parent = Path(mountpoint + (path or ""))
                if path and controller in _read(parent / "cgroup.subtree_control").split():
                    found.append(_Hierarchy(controller, parent, 2))
    return [h for h in found if os.access(h.parent, os.W_OK)]


class EpisodeCgroups:
    """The cgroups of one episode: processes join them through `procs_files`, limits apply to all."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @classmethod
    def create(cls, hierarchies: list[_Hierarchy], name: str, memory_bytes: int, max_pids: int) -> "EpisodeCgroups":
        limits = {"pids": max_pids, "memory": memory_bytes}
        dirs = []
        try:
            for h in hierarchies:
                d = h.parent / f"asyncrl-{name}"
                d.mkdir()
                dirs.append(d)
                for fname in _LIMIT_FILES[h.controller][h.version - 1]:
                    value = 0 if fname == "memory.swap.max" else limits[h.controller]
                    if (d / fname).exists():
                        (d / fname).write_text(str(value))
        except OSError:
            cls(dirs).remove_now()
            raise
        return cls(dirs)

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    async def remove(self, wait_s: float = 5.0) -> None:
        """Kill what is left inside and remove the directories (processes take a moment to exit)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        for d in self.dirs:
            while d.exists():
                _kill_members(d)
                try:
                    d.rmdir()
                except OSError:
                    if asyncio.get_running_loop().time() > deadline:
                        log.error("cgroup %s still busy after %.1fs; leaving it", d, wait_s)
                        break
                    await asyncio.sleep(0.05)

    def remove_now(self) -> None:
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass


def _kill_members(d: Path) -> None:
    for pid in _read(d / "cgroup.procs").split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""

