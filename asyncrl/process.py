"""Child service processes that cannot outlive the process that started them.

A service (engine, gateway, orchestrator, env service) is started in its own session (so it can be
signalled as a group) with PR_SET_PDEATHSIG: if its parent dies (a Ray actor killed with SIGKILL, a
launcher crash), the kernel sends it SIGTERM and it shuts down cleanly instead of lingering.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path
from typing import Optional

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(argv: list[str], log_path: Path, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True, preexec_fn=_die_with_parent)


def terminate(process: subprocess.Popen, grace_s: float) -> Optional[int]:
    """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code."""
    if process.poll() is not None:
        return process.returncode
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
    return process.returncode
