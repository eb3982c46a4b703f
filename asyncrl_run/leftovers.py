"""Processes a killed launcher left running, found and stopped by the next launch in the same run dir.

A SIGKILLed launcher cannot stop its children. Most die with it anyway: the embedded redis-server and
every service process by PR_SET_PDEATHSIG (asyncrl.process), Ray's workers with their raylet. Ray's
DashboardAgent and RuntimeEnvAgent do not: they outlived a killed launcher by ~95 s (issue 41). So once a
run is up, the launcher records its whole process tree (`record`); the next launch in the run dir stops
whichever of those processes still run (`stop_leftovers`), and says which. A process counts only if its
pid *and* start time match the record, so a reused pid is never touched.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import psutil

log = logging.getLogger(__name__)

RECORD = "processes.json"
"""In the run dir: {"launcher": {pid, started, name}, "children": [...]}, once the run was up."""


def record(run_dir: Path) -> int:
    """Record this process and its descendants; returns how many descendants."""
    children = [_entry(child) for child in psutil.Process(os.getpid()).children(recursive=True)]
    children = [entry for entry in children if entry is not None]
    (run_dir / RECORD).write_text(json.dumps({"launcher": _entry(psutil.Process(os.getpid())), "children": children}))
    return len(children)


def stop_leftovers(run_dir: Path, grace_s: float = 2.0) -> list[str]:
    """Stop the recorded processes of a previous launch that still run (SIGTERM, SIGKILL after `grace_s`);
    returns "name (pid N)" for each, and forgets the record. Refuses (RuntimeError) while that launch's
    launcher itself runs: the run dir is in use."""
    path = run_dir / RECORD
    if not path.exists():
        return []
    recorded = json.loads(path.read_text())
    launcher = _running(recorded["launcher"])
    if launcher is not None and launcher.pid != os.getpid():
        raise RuntimeError(f"{run_dir} is in use by a running launcher (pid {launcher.pid}); stop it first")
    alive = {p: entry["name"] for entry in recorded["children"] if (p := _running(entry)) is not None}
    names = [f"{name} (pid {p.pid})" for p, name in alive.items()]
    if alive:
        log.warning("the previous launch in %s left %d processes running: %s; stopping them", run_dir, len(alive),
                    ", ".join(names))
        for process in alive:
            _quietly(process.terminate)
        _, still = psutil.wait_procs(list(alive), timeout=grace_s)
        for process in still:
            _quietly(process.kill)
        psutil.wait_procs(still, timeout=grace_s)
    path.unlink()
    return names


def _entry(process: psutil.Process) -> Optional[dict]:
    try:
        return {"pid": process.pid, "started": process.create_time(), "name": process.name()}
    except psutil.Error:  # exited meanwhile
        return None


def _running(entry: Optional[dict]) -> Optional[psutil.Process]:
    """The recorded process if it still runs: same pid and start time (never a reused pid), not a zombie."""
    if entry is None:
        return None
    try:
        process = psutil.Process(entry["pid"])
        if abs(process.create_time() - entry["started"]) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
            return process
    except psutil.Error:
        pass
    return None


def _quietly(call) -> None:
    try:
        call()
    except psutil.Error:
        pass
