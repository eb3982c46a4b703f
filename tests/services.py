"""Start a real service process for a test and stop it through the handle that started it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A loopback port free now, for third-party servers that cannot bind port 0 and report it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, describe=lambda: ""):
    """Poll `predicate` until it returns something truthy (returned); else fail with `describe()`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"timed out; {describe()}")


def stop_tagged(tag: str) -> None:
    """Stop what the block started (the head and the job's processes): every process carrying our tag in
    its environment. By tag, not by name: `ray stop` would stop every Ray on the machine."""
    tagged = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("ASYNCRL_TEST_TAG") == tag:
                tagged.append(proc)
        except (psutil.Error, OSError):
            continue
    for proc in tagged:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(tagged, timeout=20)
    for proc in alive:
        proc.kill()


def unpublished_bodies(openapi: dict, bodyless: frozenset[str] = frozenset()) -> list[str]:
    """'METHOD path' of each POST/PUT operation of an OpenAPI document that publishes no JSON requestBody
    schema, other than the `bodyless` ones (routes documented to take no body)."""
    missing = []
    for path, operations in openapi["paths"].items():
        for method in ("post", "put"):
            operation = operations.get(method)
            name = f"{method.upper()} {path}"
            if operation is None or name in bodyless:
                continue
            schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if not schema:
                missing.append(name)
    return missing


class ServiceProcess:
    """`python -m <module> ... --port 0 --url-file F` as a child process; `url` once it serves.
    A fixed `port` restarts a service where its clients expect it; `python` runs it with another interpreter."""

    def __init__(self, module: str, args: list[str], workdir: Path, name: Optional[str] = None,
                 env: Optional[dict[str, str]] = None, port: int = 0, python: Optional[str] = None) -> None:
        self.name = name or module
        self.url_file = workdir / f"{self.name}.url"
        self.log_path = workdir / f"{self.name}.log"
        self.url_file.unlink(missing_ok=True)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [python or sys.executable, "-m", module, *args, "--port", str(port), "--url-file", str(self.url_file)],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.url = self._wait_url()

    def _wait_url(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.url_file.exists():
                return self.url_file.read_text().strip()
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.name} did not start in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def kill(self) -> None:
        """Crash it (SIGKILL), as a failing machine would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 20.0) -> int:
        """Graceful SIGTERM, SIGKILL if it hangs; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


async def health_latencies_while(http, path: str, body: dict) -> tuple[object, list[float]]:
    """POST `body` to `path` while polling GET /health on the same service (`http`, an httpx.AsyncClient):
    (the POST's response, each /health latency in seconds). The body is serialized before the clock
    starts: httpx's json.dumps of a million ids would stall this test's own loop for ~200 ms."""
    content = orjson.dumps(body)
    pending = asyncio.ensure_future(http.post(path, content=content, headers={"content-type": "application/json"}))
    latencies = []
    while not pending.done():
        started = time.monotonic()
        assert (await http.get("/health")).status_code == 200
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(0.01)
    return await pending, latencies
