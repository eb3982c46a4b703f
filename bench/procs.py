"""Child processes of the benchmarks: serve on 127.0.0.1, write their URL to --url-file, and are measured
(CPU seconds, RSS) and stopped by the handle that started them."""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Union

import psutil

ROOT = Path(__file__).resolve().parents[1]


Priority = Union[int, str]
"""A child's CPU priority: a nice increment, "idle" (SCHED_IDLE: it runs only on CPU time no other process
wants, as a load generator on nodes of its own would take none from the processes measured), or "fifo"
(SCHED_FIFO: it runs the moment it wakes, ahead of every normal process; root only)."""


def parse_priority(value: str) -> Priority:
    if value in ("idle", "fifo"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a nice increment (an integer), 'idle' or 'fifo'") from None


def lower_priority(priority: Priority) -> None:
    """In the child, before exec."""
    if priority == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif priority == "fifo":
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    elif priority:
        os.nice(priority)


def policy_name(pid: int) -> str:
    """The scheduling policy a process runs under, as read from it (what a Priority reached)."""
    return {os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_IDLE: "SCHED_IDLE", os.SCHED_OTHER: "SCHED_OTHER"}.get(
        os.sched_getscheduler(pid), "other")


def fifo_permitted() -> bool:
    """Whether this process may give a child SCHED_FIFO (root with CAP_SYS_NICE, and real-time runtime in its
    cgroup): tried on itself and undone at once."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return True


def parse_cpus(value: str) -> frozenset[int]:
    """'0' or '0,2-3' -> {0} or {0, 2, 3}; '' -> no pinning."""
    cpus: set[int] = set()
    try:
        for part in filter(None, value.split(",")):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: CPU numbers such as 0 or 0,2-3") from None
    return frozenset(cpus)


class Measured:
    """A process whose CPU seconds and RSS are read."""

    def __init__(self, pid: int) -> None:
        self.ps = psutil.Process(pid)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def rss(self) -> int:
        return self.ps.memory_info().rss


class Proc(Measured):
    """A child serving on 127.0.0.1 `port` (0: a free one) that writes its URL to --url-file."""

    def __init__(self, workdir: Path, name: str, argv: list[str], priority: Priority = 0, port: int = 0,
                 cpus: frozenset[int] = frozenset()) -> None:
        """`cpus`: the CPUs it runs on (empty: the parent's)."""
        self.url_file = workdir / f"{name}.url"
        self.url_file.unlink(missing_ok=True)
        self.log = open(workdir / f"{name}.log", "ab")
        self.popen = subprocess.Popen([*argv, "--port", str(port), "--url-file", str(self.url_file)], cwd=ROOT,
                                      stdout=self.log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)},
                                      preexec_fn=lambda: self._setup(priority, cpus))
        super().__init__(self.popen.pid)

    @staticmethod
    def _setup(priority: Priority, cpus: frozenset[int]) -> None:
        """In the child, before exec."""
        if cpus:
            os.sched_setaffinity(0, cpus)
        lower_priority(priority)

    def wait_url(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.url_file.exists():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.url_file.stem} did not start: {self.log.name}")
            time.sleep(0.05)
        return self.url_file.read_text().strip()

    def kill(self) -> None:
        """SIGKILL, as a machine failing would."""
        self.popen.kill()
        self.popen.wait()
        self.log.close()

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self.log.close()

