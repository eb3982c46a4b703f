"""`RolloutEngine`: the Ray actor that hosts one engine server process and keeps it healthy.

The actor launches the configured backend (built-in CPU engine or SGLang) as a child process,
publishes its URL in Redis (`engines` hash), and runs a health monitor thread: every
`health_check_interval_s` it calls /health_generate; a failed or dead engine is killed and started
again with the *current* weights (the `weights` hash the trainer writes at every push). If the actor
itself dies, Ray restarts it (max_restarts=-1) and __init__ does the same: nothing but in-flight
requests is lost, and the gateway re-routes those.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from asyncrl.config import RolloutConfig
from asyncrl.store import Store, run_sync
from rollout.backends import LaunchSpec, make_backend

log = logging.getLogger("rollout.actor")


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests of the class itself)
        return "127.0.0.1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RolloutEngine:
    def __init__(self, cfg: RolloutConfig, engine_id: str, model_path: str, redis_url: str, run: str,
                 work_dir: str, seed: int = 0, tokenizer_path: Optional[str] = None,
                 bind_host: str = "127.0.0.1") -> None:
        self.cfg, self.engine_id = cfg, engine_id
        self.initial_model_path, self.tokenizer_path, self.seed = model_path, tokenizer_path, seed
        self.redis_url, self.run = redis_url, run
        self.work_dir = Path(work_dir)
        self.backend = make_backend(cfg)
        self.host = bind_host
        self.public_host = _node_ip() if bind_host == "0.0.0.0" else bind_host
        self.port = _free_port(bind_host)
        self.process: Optional[subprocess.Popen] = None
        self.serving = False
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._launch()
        self._monitor = threading.Thread(target=self._watch, name=f"{engine_id}-health", daemon=True)
        self._monitor.start()

    # Queries -----------------------------------------------------------------------------------
    def url(self) -> str:
        return f"http://{self.public_host}:{self.port}"

    def status(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "url": self.url(), "pid": self.process.pid if self.process else None,
                "restarts": self.restarts, "serving": self.serving and self.process.poll() is None}

    # Lifecycle ---------------------------------------------------------------------------------
    def _current_weights(self) -> tuple[str, str]:
        """(checkpoint path, version) the engine must serve: the last push, else the initial model."""
        async def read() -> dict[str, str]:
            store = Store.connect(self.redis_url, self.run)
            try:
                return await store.get_weights()
            finally:
                await store.close()
        weights = run_sync(read())
        if weights.get("location") and Path(weights["location"]).exists():
            return weights["location"], weights["version"]
        return self.initial_model_path, "0"

    def _launch(self) -> None:
        path, version = self._current_weights()
        spec = LaunchSpec(model_path=path, host=self.host, port=self.port, weight_version=version,
                          log_path=self.work_dir / f"{self.engine_id}.log", tokenizer_path=self.tokenizer_path,
                          seed=self.seed)
        self.serving = False
        self.process = self.backend.launch(spec)
        self._wait_healthy(timeout_s=self.cfg.health_check_timeout_s * 10)
        self.serving = True
        run_sync(self._register())
        log.info("%s serving %s (weights %s, version %s, pid %d)", self.engine_id, self.url(), path, version,
                 self.process.pid)

    async def _register(self) -> None:
        store = Store.connect(self.redis_url, self.run)
        try:
            await store.register_engine(self.engine_id, self.url())
        finally:
            await store.close()

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.engine_id}: engine exited with {self.process.returncode}; "
                                   f"see {self.work_dir / (self.engine_id + '.log')}")
            if self._probe("/health", timeout_s=2.0):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.engine_id}: engine not healthy after {timeout_s:.0f}s")

    def _probe(self, path: str, timeout_s: float) -> bool:
        local = "127.0.0.1" if self.host == "0.0.0.0" else self.host
        try:
            return httpx.get(f"http://{local}:{self.port}{path}", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _watch(self) -> None:
        while not self._stopping.wait(self.cfg.health_check_interval_s):
            healthy = self.process.poll() is None and self._probe("/health_generate", self.cfg.health_check_timeout_s)
            if healthy or self._stopping.is_set():
                continue
            log.warning("%s unhealthy (exit code %s): restarting with the current weights", self.engine_id,
                        self.process.poll())
            with self._lock:
                self._terminate(grace_s=2.0)
                self._launch()
                self.restarts += 1

    def restart(self) -> dict[str, Any]:
        """Kill and relaunch the engine process now (current weights)."""
        with self._lock:
            self._terminate(grace_s=5.0)
            self._launch()
            self.restarts += 1
        return self.status()

    def _terminate(self, grace_s: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def shutdown(self) -> None:
        """Graceful: stop monitoring, SIGTERM the engine (it aborts in-flight work), unregister."""
        self._stopping.set()
        with self._lock:
            self._terminate(grace_s=15.0)

        async def unregister() -> None:
            store = Store.connect(self.redis_url, self.run)
            try:
                await store.unregister_engine(self.engine_id)
            finally:
                await store.close()
        run_sync(unregister())


class EngineGroup:
    """N `RolloutEngine` actors placed by Ray with the configured resources; restarted on death."""

    def __init__(self, cfg: RolloutConfig, model_path: str, redis_url: str, run: str, work_dir: str,
                 seed: int = 0, tokenizer_path: Optional[str] = None) -> None:
        import ray

        actor_cls = ray.remote(RolloutEngine)
        self.actors = [
            actor_cls.options(name=f"{run}-engine-{i}", num_cpus=cfg.num_cpus_per_engine,
                              num_gpus=cfg.num_gpus_per_engine, max_restarts=-1, max_task_retries=3,
                              max_concurrency=4)
            .remote(cfg, f"engine-{i}", model_path, redis_url, run, work_dir, seed + i, tokenizer_path)
            for i in range(cfg.num_engines)
        ]

    def urls(self, timeout_s: float = 300.0) -> list[str]:
        import ray

        return ray.get([a.url.remote() for a in self.actors], timeout=timeout_s)

    def shutdown(self) -> None:
        import ray

        ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
