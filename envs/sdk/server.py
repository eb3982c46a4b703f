"""An Environment served over HTTP: sandbox check, task list, app, uvicorn, registration, drain.

    start: probe the sandbox (refuse to start without isolation unless the operator chose
           local_unsafe) -> list tasks -> bind -> serve -> register with the orchestrator
    stop:  refuse new episodes (503) -> deregister -> let running ones finish for drain_grace_s,
           abort the rest (their callers get status "aborted") -> close the server -> release sandboxes
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import uvicorn

from envs.sdk.app import create_app
from envs.sdk.base import Environment
from envs.sdk.context import ContextConfig
from envs.sdk.metrics import ServiceMetrics
from asyncrl.network import http_url
from asyncrl.protocols.orchestrator import RegisterRequest
from envs.sdk.registration import DEFAULT_GONE_AFTER_S, Registrar
from envs.sdk.runner import EpisodeRunner
from envs.sdk.sandbox import SandboxBackend, SandboxConfig, SandboxUnavailable, make_sandbox_backend

log = logging.getLogger("envs.server")


@dataclass
class ServiceConfig:
    name: Optional[str] = None
    """Service name in the orchestrator's rotation; None = the env class's `name` (else the class name)."""
    domain: Optional[str] = None
    """None = the env class's `domain`, else the service name: never empty."""
    capacity: int = 64
    """Episodes run concurrently; one more is answered 429."""
    weight: float = 1.0
    """Dispatch weight sent with the registration."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 binds a free port; the bound URL is printed and written to --url-file."""
    public_url: Optional[str] = None
    """URL the orchestrator should call, when it differs from http://host:port (NAT, containers)."""
    orchestrator_url: Optional[str] = None
    """Register with this orchestrator and heartbeat to it; None = an operator registers the service."""
    orchestrator_token: Optional[str] = None
    auth_token: Optional[str] = field(default=None, repr=False)
    """Callers (the orchestrator, `asyncrl eval`) must send `Authorization: Bearer <token>` on every route
    but /health and /metrics; None: any caller is served."""
    orchestrator_gone_s: Optional[float] = DEFAULT_GONE_AFTER_S
    """No accepted registration or heartbeat for this long: the orchestrator is gone, the service stops
    (`gone` is set; envs.serve exits 3). None: wait for it forever."""
    drain_grace_s: float = 30.0
    """On shutdown, running episodes get this long to finish before they are aborted."""
    llm_max_retries: int = 1
    """Retries of a failed model call inside one episode (the orchestrator retries whole episodes)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    """Context management of the env's AgentLoops (keep-recent-k, discard-all: envs/sdk/context.py)."""
    section: Optional[Any] = None
    """The config section the service was started from (envs.serve: its EnvServiceConfig), reported by
    GET /server_info; None reports this ServiceConfig."""


class EnvService:
    def __init__(self, env: Environment, config: ServiceConfig):
        self.env = env
        self.config = config
        self.name = config.name or getattr(env, "name", None) or type(env).__name__
        self.domain = config.domain or getattr(env, "domain", None) or self.name
        self.url: Optional[str] = None
        self.sandboxes: Optional[SandboxBackend] = None
        self.registrar: Optional[Registrar] = None
        self._server: Optional[uvicorn.Server] = None
        self._serving: Optional[asyncio.Task] = None
        sandbox_type = config.sandbox.type if env.requires_sandbox else "none"
        self.metrics = ServiceMetrics(self.name, sandbox_type)
        self.runner: Optional[EpisodeRunner] = None

    async def start(self) -> str:
        """Serve and (when configured) register; returns the URL. Raises SandboxUnavailable."""
        self.sandboxes = await self._open_sandboxes()
        self.runner = EpisodeRunner(self.env, self.config.capacity, self.sandboxes, self.metrics,
                                    self.config.llm_max_retries, self.config.context)
        await self.runner.load_tasks()
        app = create_app(self.runner, self.metrics, self.name, self.domain, self.config.auth_token,
                         self.config.section or self.config)
        sock = _bind(self.config.host, self.config.port)
        self.url = self.config.public_url or http_url(self.config.host, sock.getsockname()[1])
        self._server = _QuietServer(uvicorn.Config(app, log_config=None, access_log=False,
                                                   timeout_graceful_shutdown=5))
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]), name="uvicorn")
        while not self._server.started:
            if self._serving.done():
                await self._serving  # surfaces the startup error
            await asyncio.sleep(0.01)
        log.info("env %s (domain %s, %d tasks, capacity %d) listening on %s", self.name, self.domain,
                 len(self.runner.task_ids), self.config.capacity, self.url)
        self._start_registration()
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            self.runner.refuse_new()
        if self.registrar is not None:
            await self.registrar.stop()
        if self.runner is not None:
            await self.runner.drain(self.config.drain_grace_s)
        if self._server is not None:
            self._server.should_exit = True
            await self._serving
        if self.sandboxes is not None:
            await self.sandboxes.close()
        log.info("env %s stopped", self.name)

    async def _open_sandboxes(self) -> Optional[SandboxBackend]:
        if not self.env.requires_sandbox:
            return None
        backend = make_sandbox_backend(self.config.sandbox)
        try:
            await backend.probe()
        except SandboxUnavailable:
            await backend.close()
            raise
        if backend.type == "local_unsafe":
            log.warning("UNSAFE SANDBOX: env %s runs agent-controlled commands (requires_sandbox) WITHOUT isolation: "
                        "as uid %d, with network access and the service's file permissions (sandbox type "
                        "local_unsafe was chosen)", self.name, os.geteuid())
        return backend

    def _start_registration(self) -> None:
        if not self.config.orchestrator_url:
            return
        registration = RegisterRequest(name=self.name, domain=self.domain, url=self.url,
                                       capacity=self.config.capacity, weight=self.config.weight)
        self.registrar = Registrar(self.config.orchestrator_url, registration, lambda: self.runner.in_flight,
                                   token=self.config.orchestrator_token, gone_after_s=self.config.orchestrator_gone_s)
        self.registrar.start()


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: whoever runs the service decides what SIGTERM does."""

    def capture_signals(self):
        return nullcontext()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
