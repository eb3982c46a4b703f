"""Real processes for the orchestrator tests: redis-server (session fixture), orchestrators, env
services (tests/orchestrator/timed_env.py, served by `python -m envs.serve`), stopped by their handles.

Env services of the shared pool run without --orchestrator: each test's orchestrator registers them
over HTTP in probe mode (what `asyncrl env register` does), so one pool serves every test. Tests that
kill or freeze services, or need self-registration, start their own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

from asyncrl.store import Store
from asyncrl.types import GroupRecord
from tests.envs.service_process import ServiceProcess as EnvProcess
from tests.services import ServiceProcess

ROOT_DIR = Path(__file__).resolve().parents[2]
TIMED_ENV = "tests.orchestrator.timed_env.TimedEnv"
FAST = ["--heartbeat-interval-s", "0.3", "--heartbeat-timeout-s", "3", "--lease-ttl-s", "2",
        "--backpressure-interval-s", "0.2", "--max-unconsumed-groups", "0"]
"""Test timings: heartbeats every 0.3 s, unhealthy after 3 s silent (generous: the CI machine is shared)."""


class Orchestrator:
    """An `asyncrl orchestrator serve` process and an HTTP client for its API."""

    def __init__(self, workdir: Path, redis_url: str, run: str, *args: str, name: str = "orchestrator",
                 port: int = 0, token: Optional[str] = None) -> None:
        llm = [] if "--gateway" in args or "--llm-url" in args else ["--llm-url", f"http://127.0.0.1:9/{run}/v1"]
        self.proc = ServiceProcess("orchestrator.server", ["--redis-url", redis_url, "--run", run, *llm, *FAST, *args],
                                   workdir, name=name, port=port)
        self.url = self.proc.url
        self.port = int(self.url.rsplit(":", 1)[1])
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, timeout=30, headers=headers)

    def status(self) -> dict:
        reply = self.http.get("/v1/status")
        assert reply.status_code == 200, reply.text
        return reply.json()

    def envs(self) -> list[dict]:
        return self.http.get("/v1/envs").json()

    def register(self, service_url: str, name: str = "timed", capacity: int = 8, domain: str = "test",
                 weight: float = 1.0) -> str:
        body = {"name": name, "domain": domain, "url": service_url, "capacity": capacity, "weight": weight,
                "heartbeat": "probe"}
        reply = self.http.post("/v1/envs", json=body)
        assert reply.status_code == 201, reply.text
        return reply.json()["env_id"]

    def wait(self, predicate: Callable[[dict], bool], timeout_s: float = 60.0, what: str = "") -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status()
            if predicate(status):
                return status
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what or predicate}; status {status}\n{self.proc.log()}")

    def wait_done(self, groups: int, timeout_s: float = 90.0) -> dict:
        """Until `groups` groups are complete, their records in Redis, and nothing is open or running."""
        return self.wait(lambda s: s["groups_recorded"] >= groups and s["groups_open"] == 0 and s["in_flight"] == 0,
                         timeout_s, f"{groups} complete groups")

    def kill(self) -> None:
        self.http.close()
        self.proc.kill()

    def stop(self) -> int:
        self.http.close()
        return self.proc.stop()


def start_envs(workdir: Path, count: int, *args: str, env: str = TIMED_ENV) -> list[EnvProcess]:
    """`count` env services started in parallel (each spends seconds importing)."""
    services = [EnvProcess(env, workdir, *args).spawn() for _ in range(count)]
    return [service.wait_ready() for service in services]


def journal(directory: Path, run: Optional[str] = None) -> list[dict]:
    """What TimedEnv services were sent (entries of this run's orchestrator when `run` is given)."""
    entries = [json.loads(line) for path in directory.glob("*.jsonl") for line in path.read_text().splitlines()]
    return sorted((e for e in entries if run is None or f"/{run}/" in e["base_url"]),
                  key=lambda e: e["at"])


def running_at(directory: Path, pid: int) -> int:
    """Episodes the service `pid` has started and not ended, by its journal. A kill test waits for this
    as well as the orchestrator's in_flight, which counts dispatches the service may not have begun."""
    return sum(1 if e["event"] == "start" else -1 for e in journal(directory) if e["pid"] == pid)


def max_concurrency(entries: list[dict], pid: Optional[int] = None) -> int:
    """Most episodes running at once (at one service when `pid` is given), from start/end entries."""
    level, peak = 0, 0
    for e in entries:
        if pid is None or e["pid"] == pid:
            level += 1 if e["event"] == "start" else -1
            peak = max(peak, level)
    return peak


def starts_by_episode(entries: list[dict]) -> dict[str, dict]:
    return {e["episode_id"]: e for e in entries if e["event"] == "start"}


async def group_records(redis_url: str, run: str) -> list[GroupRecord]:
    store = Store.connect(redis_url, run)
    try:
        return [GroupRecord.decode(fields) for _, fields in await store.redis.xrange(store.key("groups"))]
    finally:
        await store.close()


@pytest.fixture(scope="session")
def journal_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("journal")


@pytest.fixture(scope="session")
def env_pool(tmp_path_factory, journal_dir) -> list[EnvProcess]:
    """Four TimedEnv services (0.4 s episodes, capacity 8) shared by the tests that kill nothing."""
    services = start_envs(tmp_path_factory.mktemp("pool"), 4, "--capacity", "8", "--option", "sleep_s=0.4",
                          "--option", f"journal={journal_dir}", "--log-level", "WARNING")
    yield services
    for service in services:
        service.terminate()
    for service in services:
        service.stop()


@pytest.fixture
def gateway(tiny_checkpoint, tmp_path, redis_server, run_name):
    """A real TITO gateway recording this test's run, in front of the built-in CPU engine (tiny model)."""
    pytest.importorskip("gateway.server", reason="the gateway component is not in this tree")
    from tests.rollout.conftest import start_engine

    engine = start_engine(tiny_checkpoint, tmp_path, name="engine")
    proc = ServiceProcess("gateway.server", ["--engine", engine.url, "--redis-url", redis_server.url, "--run",
                                             run_name], tmp_path, name="gateway")
    yield proc
    assert proc.stop() == 0, proc.log()
    assert engine.stop() == 0, engine.log()


@pytest.fixture
def orchestrators(tmp_path, redis_server, run_name):
    """start(*args) -> a running Orchestrator on this test's run; all stopped at teardown."""
    started: list[Orchestrator] = []

    def start(*args: str, **kwargs) -> Orchestrator:
        started.append(Orchestrator(tmp_path, redis_server.url, run_name, *args,
                                    name=f"orchestrator-{len(started)}", **kwargs))
        return started[-1]

    yield start
    for orch in started:
        if orch.proc.process.poll() is None:
            assert orch.stop() == 0, orch.proc.log()
