"""The gateway: its parts (engine pool, turn runner, session registry, turns) wired from one GatewayConfig,
with one method per HTTP route, so that gateway/server.py only parses, calls and replies."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.config import GatewayConfig
from asyncrl.protocols.gateway import (ChatCompletionRequest, CreateSessionRequest, CreateSessionResponse,
                                       EnginesResponse)
from asyncrl.store import Store
from gateway.engines import EnginePool
from gateway.generation import TurnRunner
from gateway.metrics import GatewayMetrics
from gateway.sessions import SessionRegistry
from gateway.turns import Turns

log = logging.getLogger("gateway.server")

SWEEP_INTERVAL_S = 10.0
ENGINE_LATENCY_HEADER = "x-engine-latency-s"
"""On chat replies: seconds the engines spent on the turn (their e2e_latency), so a client can tell
gateway and transport time from model time."""


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


class Gateway:
    def __init__(self, cfg: GatewayConfig, template: GlmChatTemplate, store: Optional[Store]) -> None:
        self.cfg, self.store = cfg, store
        engine_registry = store.engines if (cfg.engines_from_redis and store is not None) else None
        self.pool = EnginePool(cfg.engine_urls, cfg.engine_timeout_s, cfg.load_factor, cfg.health_interval_s,
                               registry=engine_registry, api_key=cfg.engine_api_key,
                               balance_abs_threshold=cfg.balance_abs_threshold)
        self.metrics = GatewayMetrics(lambda: self.sessions.active, lambda: self.engines_healthy)
        runner = TurnRunner(self.pool, self.metrics, cfg.max_interruptions, engine_wait_s=cfg.engine_wait_s,
                            routing_replay=cfg.routing_replay)
        self.sessions = SessionRegistry(cfg, runner, store, self.metrics)
        self.turns = Turns(template, runner, self.metrics, cfg.model_name, self.sessions.spawn)
        self._sweeper: Optional[asyncio.Task] = None

    @property
    def engines_healthy(self) -> int:
        return sum(e.healthy for e in self.pool.engines.values())

    def start(self) -> None:
        self.pool.start()
        self._sweeper = asyncio.create_task(self.sessions.sweep_forever(SWEEP_INTERVAL_S))

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        aborted = await self.sessions.shutdown()
        log.info("shutdown: %d open sessions aborted (not recorded)", aborted)
        await self.pool.close()
        if self.store is not None:
            await self.store.close()

    def create_session(self, body: CreateSessionRequest, caller_base_url: str) -> CreateSessionResponse:
        """A new session; its base_url under public_url, else under the URL the caller used."""
        session = self.sessions.create(body)
        base = (self.cfg.public_url or caller_base_url).rstrip("/")
        return CreateSessionResponse(session_id=session.id, base_url=f"{base}/sessions/{session.id}/v1",
                                     api_key=session.api_key)

    async def chat(self, sid: str, body: ChatCompletionRequest, request: Request) -> Response:
        """One chat turn of session `sid`: the completion, or its event stream."""
        session = self.sessions.open(sid)
        if not body.stream:
            completion, engine_latency_s = await self.turns.chat(session, body, request)
            response = json_response(completion)
            response.headers[ENGINE_LATENCY_HEADER] = f"{engine_latency_s:.6f}"
            return response
        _, plan = await self.turns.plan_chat(session, body)  # dry run: a bad request is a 400 before the stream
        self.turns.chat_sampling(session, body, plan)
        return StreamingResponse(self.turns.chat_stream(session, body), media_type="text/event-stream")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "asyncrl"}]}

    def engines(self) -> EnginesResponse:
        return EnginesResponse(engines=self.pool.status())

    async def set_engines(self, urls: list[str]) -> EnginesResponse:
        self.pool.set_engines(urls)
        await self.pool.check_health()
        log.info("routing over %s", urls)
        return self.engines()

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "sessions_active": self.sessions.active, "engines_healthy": self.engines_healthy}
