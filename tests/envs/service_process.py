"""Starts an env service the way an operator does (`python -m envs.serve`), and stops it by its handle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parents[2]


class ServiceProcess:
    """`python -m envs.serve --env ENV ...` of this checkout; with `python` (another venv's interpreter) run in
    `workdir` and without this checkout on its path, so that it imports only what that venv has installed."""

    live: set["ServiceProcess"] = set()
    """Spawned and not stopped: tests/conftest.py stops what a test left (an assertion that failed before its
    stop() left a service running through every later test)."""

    def __init__(self, env: str, workdir: Path, *args: str, python: Optional[Path] = None):
        self.env = env
        self.url_file = workdir / f"{env.rsplit('.', 1)[-1]}-{time.monotonic_ns()}.url"
        self.log_path = self.url_file.with_suffix(".log")
        self.argv = [str(python or sys.executable), "-m", "envs.serve", "--env", env, "--port", "0",
                     "--url-file", str(self.url_file), *args]
        if python is None:
            self.cwd, self.environ = ROOT, {**os.environ, "PYTHONPATH": str(ROOT)}
        else:
            self.cwd, self.environ = workdir, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""

    def start(self, timeout_s: float = 90.0) -> "ServiceProcess":
        return self.spawn().wait_ready(timeout_s)

    def spawn(self) -> "ServiceProcess":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.environ)
        ServiceProcess.live.add(self)
        return self

    def wait_ready(self, timeout_s: float = 90.0) -> "ServiceProcess":
        deadline = time.monotonic() + timeout_s
        while not self.url_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.env} did not start (rc={self.proc.poll()}):\n{self.log()}")
            time.sleep(0.05)
        self.url = self.url_file.read_text()
        return self

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout_s)

    def terminate(self) -> None:
        """Send SIGTERM without waiting (stop() waits)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> Optional[int]:
        """SIGTERM, then SIGKILL if it does not exit within 20 s."""
        if self.proc is None:
            return None
        ServiceProcess.live.discard(self)
        self.terminate()
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30)


def episode_request(task_id: str, base_url: str, episode_id: Optional[str] = None, **overrides) -> dict:
    body = {"episode_id": episode_id or f"e-{time.monotonic_ns()}", "task_id": task_id, "seed": 0,
            "llm": {"base_url": base_url, "model": "scripted", "api_key": None,
                    "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64}},
            "max_turns": 10, "deadline_s": 120}
    body.update(overrides)
    return body


async def run_episode(client: httpx.AsyncClient, service_url: str, task_id: str, base_url: str, **overrides) -> dict:
    reply = await client.post(f"{service_url}/episodes", json=episode_request(task_id, base_url, **overrides),
                              timeout=180)
    assert reply.status_code == 200, reply.text
    return reply.json()
