"""Supervised service processes, the body of every Ray actor that hosts a service.

`Supervisor` starts a service process (`launch()`), waits until it answers its health path, and
watches it from a thread: a process that exits or stops answering is killed and started again, and
so is a healthy one whose `restart_requested()` says so on a tick (an engine that did not take a
weight push). Subclasses say how to launch (`command()`), how to reach it (`url()`), and what to do
once it serves (`on_serving()`, e.g. publish the URL). When the hosting actor dies, its children die with
it (asyncrl.process), and Ray's actor restart runs __init__ again: the same recovery path.

`ServiceActor` is the generic case: `python -m <module> <args> --port P --url-file F` (gateway,
orchestrator, env services all follow that convention). The files its command line reads (its
config) travel with the actor, so it runs the same on a node that does not share the launcher's disk;
every service learns its node's address ($ASYNCRL_NODE_IP, asyncrl.network) to advertise its URL by.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import httpx

from asyncrl.network import NODE_IP_ENV, node_ip
from asyncrl.process import spawn, terminate

log = logging.getLogger("asyncrl.supervisor")

RESTART_ATTEMPTS = 3
"""Failed restarts in a row (one per health-check tick) after which a service is given up for."""


class Supervisor(ABC):
    def __init__(self, name: str, work_dir: str, health_path: str = "/health", check_interval_s: float = 5.0,
                 check_timeout_s: float = 30.0, start_timeout_s: float = 300.0) -> None:
        self.name, self.work_dir = name, Path(work_dir)
        self.health_path, self.check_interval_s = health_path, check_interval_s
        self.check_timeout_s, self.start_timeout_s = check_timeout_s, start_timeout_s
        self.process: Optional[subprocess.Popen] = None
        self.serving = False
        self.restarts = 0
        self.failed_restarts = 0
        """Restarts in a row that did not bring the service back (reset by one that did)."""
        self.failure: Optional[str] = None
        """Why the service is given up for (RESTART_ATTEMPTS failed restarts in a row): the launcher stops the
        run naming it (status()["failure"]) instead of waiting on a dead component."""
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # What a service defines -----------------------------------------------------------------------
    @abstractmethod
    def command(self) -> list[str]:
        """argv of the service process (called at every (re)start)."""

    @abstractmethod
    def url(self) -> str:
        """Where others reach the service once it serves."""

    def environment(self) -> dict[str, str]:
        return {}

    def on_serving(self) -> None:
        """Called after every (re)start once the service answers."""

    def before_start(self) -> None:
        """Called before every (re)start."""

    def restart_requested(self) -> bool:
        """Asked on every health-check tick while the service is healthy: True restarts it."""
        return False

    # Lifecycle --------------------------------------------------------------------------------------
    @property
    def log_path(self) -> Path:
        return self.work_dir / f"{self.name}.log"

    def start(self) -> "Supervisor":
        self._launch()
        threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()
        return self

    def _launch(self) -> None:
        self.serving = False
        self.before_start()
        self.process = spawn(self.command(), self.log_path, {NODE_IP_ENV: node_ip(), **self.environment()})
        (self.work_dir / f"{self.name}.pid").write_text(str(self.process.pid))  # for operators and tests
        self._wait_healthy()
        self.serving = True
        self.on_serving()
        log.info("%s serving at %s (pid %d)", self.name, self.url(), self.process.pid)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = _tail(self.log_path)
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} while starting "
                                   f"({tail.splitlines()[-1] if tail else 'empty log'}; log {self.log_path})\n{tail}")
            if self._probe(timeout_s=2.0):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} did not answer {self.health_path} in {self.start_timeout_s:.0f}s")

    def _probe(self, timeout_s: float) -> bool:
        try:
            return httpx.get(self.url() + self.health_path, timeout=timeout_s).status_code == 200
        except (httpx.HTTPError, OSError, RuntimeError):
            return False

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_interval_s):
            healthy = self.process.poll() is None and self._probe(self.check_timeout_s)
            if healthy and not self.restart_requested():
                continue
            if self._stopping.is_set():
                return
            if healthy:
                log.warning("%s: restart requested", self.name)
            else:
                log.warning("%s is down (exit code %s): restarting", self.name, self.process.poll())
            try:
                self.restart()
                self.failed_restarts = 0
            except Exception as err:  # noqa: BLE001 - tried again on the next tick, then given up
                self.failed_restarts += 1
                log.error("%s: restart %d of %d failed: %s", self.name, self.failed_restarts, RESTART_ATTEMPTS, err)
                if self.failed_restarts >= RESTART_ATTEMPTS:
                    self.failure = f"could not be restarted ({RESTART_ATTEMPTS} attempts): {str(err).splitlines()[0]}"
                    return

    def restart(self) -> dict[str, Any]:
        with self._lock:
            terminate(self.process, grace_s=5.0)
            self._launch()
            self.restarts += 1
        return self.status()

    def status(self) -> dict[str, Any]:
        alive = self.process is not None and self.process.poll() is None
        return {"name": self.name, "url": self.url() if self.serving else None, "serving": self.serving and alive,
                "pid": self.process.pid if self.process else None, "restarts": self.restarts, "failure": self.failure}

    def shutdown(self, grace_s: float = 20.0) -> Optional[int]:
        """Stop watching, SIGTERM the service (it drains), return its exit code."""
        self._stopping.set()
        with self._lock:
            return terminate(self.process, grace_s) if self.process else None


class ServiceActor(Supervisor):
    """`python -m module args... --port P --url-file F`: the URL is read from the file at each start.

    A restart binds where the service was, so its clients (the orchestrator's gateway URL, the env services'
    orchestrator URL) find it where they look: port 0 takes a free port at the first start only, and an
    actor that Ray restarted takes its predecessor's (from the URL file it left on this node). A port that
    cannot be bound again fails the restart, and after RESTART_ATTEMPTS the run (Supervisor.failure)."""

    def __init__(self, name: str, module: str, args: list[str], work_dir: str, env: Optional[dict[str, str]] = None,
                 port: int = 0, python: Optional[str] = None, files: Optional[dict[str, str]] = None,
                 **supervisor_options: Any) -> None:
        super().__init__(name, work_dir, **supervisor_options)
        for path, text in (files or {}).items():  # the launcher's disk may be another host's
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        self.module, self.args, self.env, self.port = module, list(args), dict(env or {}), port
        self.python = python or sys.executable
        """The interpreter: another venv's runs a service whose dependencies do not fit the run's venv."""
        self._url: Optional[str] = None
        if not self.port and _reconstructed() and self.url_file.exists():
            self.port = _port(self.url_file.read_text())
        self.start()

    @property
    def url_file(self) -> Path:
        return self.work_dir / f"{self.name}.url"

    def before_start(self) -> None:
        self._url = None
        self.url_file.unlink(missing_ok=True)

    def command(self) -> list[str]:
        return [self.python, "-m", self.module, *self.args, "--port", str(self.port), "--url-file", str(self.url_file)]

    def environment(self) -> dict[str, str]:
        return self.env

    def on_serving(self) -> None:
        self.port = self.port or _port(self.url())

    def url(self) -> str:
        if self._url is None:
            if not self.url_file.exists():
                raise RuntimeError(f"{self.name} has not bound its port yet")
            self._url = self.url_file.read_text().strip()
        return self._url


def _port(url: str) -> int:
    return urlsplit(url.strip()).port or 0


def _reconstructed() -> bool:
    """True in a Ray actor that Ray restarted after its process died."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
    except (ImportError, RuntimeError, AttributeError):
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
