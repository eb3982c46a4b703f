"""A small real orchestrator stand-in that records the registration calls an env service makes.

It implements the three env-facing routes of docs/protocols/orchestrator.md (register,
heartbeat, deregister) with bearer-token checks, and can be told to forget a registration so the
next heartbeat gets 404.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.envs.threaded_server import ThreadedServer
from tests.services import wait_until


@dataclass
class Call:
    method: str
    path: str
    body: Optional[dict]
    authorization: Optional[str]
    at: float = field(default_factory=time.monotonic)


class RecordingOrchestrator:
    def __init__(self, token: Optional[str] = None, heartbeat_interval_s: float = 0.2, port: int = 0):
        self.token = token
        self.heartbeat_interval_s = heartbeat_interval_s
        self.calls: list[Call] = []
        self.registered: dict[str, dict] = {}
        self._ids = itertools.count(1)
        self._server = ThreadedServer(self._app(), port)

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> "RecordingOrchestrator":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def forget(self, env_id: str) -> None:
        self.registered.pop(env_id, None)

    def of(self, method: str, path_part: str = "") -> list[Call]:
        return [c for c in self.calls if c.method == method and path_part in c.path]

    def registrations(self) -> list[Call]:
        return [c for c in self.calls if c.method == "POST" and c.path == "/v1/envs"]

    def wait_for(self, predicate, timeout_s: float = 20.0):
        return wait_until(predicate, timeout_s,
                          lambda: f"calls so far: {[(c.method, c.path, c.body) for c in self.calls]}")

    def _app(self) -> FastAPI:
        app = FastAPI()

        async def record(request: Request) -> Optional[JSONResponse]:
            body = await request.json() if request.method != "DELETE" else None
            auth = request.headers.get("authorization")
            self.calls.append(Call(request.method, request.url.path, body, auth))
            if self.token and auth != f"Bearer {self.token}":
                return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
            return None

        @app.post("/v1/envs")
        async def register(request: Request):
            if (refused := await record(request)) is not None:
                return refused
            env_id = f"env-{next(self._ids)}"
            self.registered[env_id] = self.calls[-1].body
            return JSONResponse({"env_id": env_id, "heartbeat_interval_s": self.heartbeat_interval_s,
                                 "heartbeat_timeout_s": 5 * self.heartbeat_interval_s}, status_code=201)

        @app.post("/v1/envs/{env_id}/heartbeat")
        async def heartbeat(env_id: str, request: Request):
            if (refused := await record(request)) is not None:
                return refused
            if env_id not in self.registered:
                return JSONResponse({"error": f"unknown env_id {env_id}"}, status_code=404)
            return {"ok": True}

        @app.delete("/v1/envs/{env_id}")
        async def deregister(env_id: str, request: Request):
            if (refused := await record(request)) is not None:
                return refused
            self.registered.pop(env_id, None)
            return {"ok": True}

        return app
