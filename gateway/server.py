"""`asyncrl gateway serve`: the TITO gateway's HTTP API (docs/protocols/gateway.md, docs/gateway.md).

Handlers are thin: parse the typed request, call the session registry or the turn logic, reply.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.config import ENGINE_API_KEY_ENV, GatewayConfig
from asyncrl.protocols.gateway import (ChatCompletionRequest, CreateSessionRequest, CreateSessionResponse,
                                       EnginesResponse, FinishSessionRequest, SessionGenerateRequest,
                                       UpdateEnginesRequest)
from asyncrl.service import GuardMiddleware, install_metrics, json_body, parse_json_body, serve
from asyncrl.store import Store
from asyncrl.tokenizer import BUILTIN_TINY, load_tokenizer
from gateway.engines import EnginePool
from gateway.errors import error_body, error_reply, install_error_handlers
from gateway.generation import TurnRunner
from gateway.metrics import GatewayMetrics
from gateway.sessions import SessionRegistry
from gateway.turns import Turns

log = logging.getLogger("gateway.server")

SWEEP_INTERVAL_S = 10.0
CLIENT_KEEP_ALIVE_S = 75.0
"""Agents pause between turns (tool calls): keep their connections open across the pause."""
ENGINE_LATENCY_HEADER = "x-engine-latency-s"
"""On chat replies: seconds the engines spent on the turn (their e2e_latency), so a client can tell
gateway and transport time from model time."""


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def build_app(cfg: GatewayConfig, template: GlmChatTemplate, store: Optional[Store]) -> FastAPI:
    registry = store.engines if (cfg.engines_from_redis and store is not None) else None
    pool = EnginePool(cfg.engine_urls, cfg.engine_timeout_s, cfg.load_factor, cfg.health_interval_s, registry=registry,
                      api_key=cfg.engine_api_key)
    metrics = GatewayMetrics(lambda: registry.active, lambda: sum(e.healthy for e in pool.engines.values()))
    runner = TurnRunner(pool, metrics, cfg.max_interruptions, engine_wait_s=cfg.engine_wait_s,
                        routing_replay=cfg.routing_replay)
    registry = SessionRegistry(cfg, runner, store, metrics)
    turns = Turns(template, runner, metrics, cfg.model_name, registry.spawn)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pool.start()
        sweeper = asyncio.create_task(registry.sweep_forever(SWEEP_INTERVAL_S))
        yield
        sweeper.cancel()
        aborted = await registry.shutdown()
        log.info("shutdown: %d open sessions aborted (not recorded)", aborted)
        await pool.close()
        if store is not None:
            await store.close()

    app = FastAPI(title="asyncrl TITO gateway", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, auth_token=cfg.auth_token, max_request_bytes=cfg.max_request_bytes,
                       error_body=error_body, also_authorized=registry.session_credential_opens)
    install_error_handlers(app)
    install_metrics(app, metrics.registry)

    # Sessions ------------------------------------------------------------------------------------------
    @app.post("/sessions", status_code=201, openapi_extra=json_body(CreateSessionRequest))
    async def create_session(request: Request) -> Response:
        body = await parse_json_body(request, CreateSessionRequest)
        session = registry.create(body)
        base = (cfg.public_url or str(request.base_url)).rstrip("/")
        reply = CreateSessionResponse(session_id=session.id, base_url=f"{base}/sessions/{session.id}/v1",
                                      api_key=session.api_key)
        return json_response(reply.model_dump(), 201)

    @app.get("/sessions/{sid}")
    async def get_session(sid: str) -> Response:
        return json_response(registry.get(sid).record().model_dump())

    @app.post("/sessions/{sid}/finish", openapi_extra=json_body(FinishSessionRequest))
    async def finish_session(sid: str, request: Request) -> Response:
        body = await parse_json_body(request, FinishSessionRequest)
        return json_response((await registry.finish(sid, body)).model_dump())

    @app.delete("/sessions/{sid}")
    async def delete_session(sid: str) -> Response:
        return json_response(registry.abort(registry.get(sid)).model_dump())

    # Turns -----------------------------------------------------------------------------------------------
    @app.post("/sessions/{sid}/generate", openapi_extra=json_body(SessionGenerateRequest))
    async def generate(sid: str, request: Request) -> Response:
        body = await parse_json_body(request, SessionGenerateRequest)
        if body.stream:
            return error_reply(request, 400, "stream: the token-native endpoint does not stream; use chat/completions")
        return json_response(await turns.generate(registry.open(sid), body, request))

    async def chat(sid: str, request: Request) -> Response:
        body = await parse_json_body(request, ChatCompletionRequest)
        session = registry.open(sid)
        if not body.stream:
            completion, engine_latency_s = await turns.chat(session, body, request)
            response = json_response(completion)
            response.headers[ENGINE_LATENCY_HEADER] = f"{engine_latency_s:.6f}"
            return response
        _, plan = await turns.plan_chat(session, body)  # dry run: bad messages or sampling are a 400 before the stream
        turns.chat_sampling(session, body, plan)
        return StreamingResponse(turns.chat_stream(session, body), media_type="text/event-stream")

    @app.post("/sessions/{sid}/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def session_chat(sid: str, request: Request) -> Response:
        return await chat(sid, request)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def header_chat(request: Request) -> Response:
        sid = request.headers.get("x-session-id")
        if not sid:
            return error_reply(request, 400, "X-Session-Id header missing (or use {gateway}/sessions/{sid}/v1)")
        return await chat(sid, request)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [
            {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}]})

    @app.get("/sessions/{sid}/v1/models")
    async def session_models(sid: str) -> Response:
        registry.get(sid)
        return await models()

    # Engines and health ----------------------------------------------------------------------------------
    @app.get("/engines")
    async def engines() -> Response:
        return json_response(EnginesResponse(engines=pool.status()).model_dump())

    @app.post("/engines", openapi_extra=json_body(UpdateEnginesRequest))
    async def set_engines(request: Request) -> Response:
        body = await parse_json_body(request, UpdateEnginesRequest)
        pool.set_engines(body.urls)
        await pool.check_health()
        log.info("routing over %s", body.urls)
        return json_response(EnginesResponse(engines=pool.status()).model_dump())

    @app.get("/health")
    async def health() -> Response:
        healthy = sum(e.healthy for e in pool.engines.values())
        return json_response({"status": "ok", "sessions_active": registry.active, "engines_healthy": healthy})

    return app


def parse_args(argv: Optional[list[str]] = None) -> tuple[GatewayConfig, str]:
    p = argparse.ArgumentParser(prog="asyncrl gateway serve", description=__doc__)
    p.add_argument("--engine", dest="engine_urls", action="append", default=[], help="engine base URL (repeat)")
    p.add_argument("--engines-from-redis", action="store_true",
                   help="follow the run's engine registry in Redis (engine actors rewrite it after restarts)")
    p.add_argument("--tokenizer", default=BUILTIN_TINY, help="tokenizer.json, a model dir, or builtin:tiny")
    p.add_argument("--no-thinking", dest="thinking", action="store_false", help="GLM non-thinking generation prompt")
    p.add_argument("--redis-url", help="Redis of the run (finished trajectories go there)")
    p.add_argument("--run", dest="run_name", default="asyncrl", help="run name (Redis key prefix)")
    p.add_argument("--auth-token", default=os.environ.get("ASYNCRL_GATEWAY_TOKEN"),
                   help="require Authorization: Bearer <token> on every route, or the session's own api_key on its "
                        "model routes (default $ASYNCRL_GATEWAY_TOKEN)")
    p.add_argument("--engine-api-key", default=os.environ.get(ENGINE_API_KEY_ENV),
                   help=f"the engines' --api-key, sent to them as a bearer token (default ${ENGINE_API_KEY_ENV})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (see --url-file)")
    p.add_argument("--url-file", help="write the bound URL here once serving")
    p.add_argument("--public-url", help="base of the session base_urls (default: the Host the caller used)")
    p.add_argument("--model-name", default="asyncrl")
    p.add_argument("--max-request-bytes", type=int, default=GatewayConfig.max_request_bytes)
    p.add_argument("--load-factor", type=float, default=GatewayConfig.load_factor)
    p.add_argument("--engine-timeout-s", type=float, default=GatewayConfig.engine_timeout_s)
    p.add_argument("--health-interval-s", type=float, default=GatewayConfig.health_interval_s)
    p.add_argument("--session-idle-timeout-s", type=float, default=GatewayConfig.session_idle_timeout_s)
    p.add_argument("--max-interruptions", type=int, default=GatewayConfig.max_interruptions)
    p.add_argument("--engine-wait-s", type=float, default=GatewayConfig.engine_wait_s,
                   help="how long a turn with no engine left waits for a healthy one before its 503")
    p.add_argument("--routing-replay", action="store_true",
                   help="ask engines for routed experts and store them with each sample (rollout.routing_replay)")
    args = vars(p.parse_args(argv))
    url_file = args.pop("url_file")
    return GatewayConfig(**args), url_file


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call otherwise
    cfg, url_file = parse_args(argv)
    template = GlmChatTemplate(load_tokenizer(cfg.tokenizer or BUILTIN_TINY), thinking=cfg.thinking)
    store = Store.connect(cfg.redis_url, cfg.run_name or "asyncrl") if cfg.redis_url else None
    if store is None:
        log.warning("no --redis-url: sessions cannot be finished (only aborted)")
    serve(build_app(cfg, template, store), cfg.host, cfg.port, url_file=url_file, keep_alive_s=CLIENT_KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
