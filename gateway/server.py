"""`asyncrl gateway serve`: the TITO gateway's HTTP API (docs/protocols/gateway.md, docs/gateway.md).

Handlers are thin: parse the typed request, call one method of the gateway (gateway/core.py), reply.
Configured by `--config FILE` (the section the launcher writes) and/or flags generated from GatewayConfig
(asyncrl.section_flags); GET /server_info reports the effective config.
"""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.config import ENGINE_API_KEY_ENV, GatewayConfig
from asyncrl.protocols.gateway import (ChatCompletionRequest, CreateSessionRequest, FinishSessionRequest,
                                       SessionGenerateRequest, UpdateEnginesRequest)
from asyncrl.section_flags import add_section_flags, parse_section
from asyncrl.service import (GuardMiddleware, install_metrics, install_server_info, json_body, parse_json_body,
                             serve)
from asyncrl.store import Store
from asyncrl.tokenizer import BUILTIN_TINY, load_tokenizer
from gateway.core import Gateway, json_response
from gateway.errors import error_body, error_reply, install_error_handlers

log = logging.getLogger("gateway.server")

TOKEN_ENV = "ASYNCRL_GATEWAY_TOKEN"
OPEN_PATHS = ("/health", "/metrics")
"""What a prober reaches without the token, as at every other asyncrl service and SGLang's --api-key: the
launcher's supervisor probes /health without one (a guarded /health kept a run with gateway.auth_token from
ever starting)."""
CLIENT_KEEP_ALIVE_S = 75.0
"""Agents pause between turns (tool calls): keep their connections open across the pause."""
FLAG_NAMES = {"engine_urls": "--engine", "run_name": "--run"}
"""Fields whose flag is not the generated --field-name (asyncrl.section_flags)."""


def build_app(cfg: GatewayConfig, template: GlmChatTemplate, store: Optional[Store]) -> FastAPI:
    gateway = Gateway(cfg, template, store)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        gateway.start()
        yield
        await gateway.stop()

    app = FastAPI(title="asyncrl TITO gateway", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, auth_token=cfg.auth_token, max_request_bytes=cfg.max_request_bytes,
                       error_body=error_body, open_prefixes=OPEN_PATHS,
                       also_authorized=gateway.sessions.session_credential_opens)
    install_error_handlers(app)
    install_metrics(app, gateway.metrics.registry)
    install_server_info(app, cfg)
    _session_routes(app, gateway)
    _model_routes(app, gateway)

    @app.get("/engines")
    async def engines() -> Response:
        return json_response(gateway.engines().model_dump())

    @app.post("/engines", openapi_extra=json_body(UpdateEnginesRequest))
    async def set_engines(request: Request) -> Response:
        body = await parse_json_body(request, UpdateEnginesRequest)
        return json_response((await gateway.set_engines(body.urls)).model_dump())

    @app.get("/health")
    async def health() -> Response:
        return json_response(gateway.health())

    return app


def _session_routes(app: FastAPI, gateway: Gateway) -> None:
    sessions = gateway.sessions

    @app.post("/sessions", status_code=201, openapi_extra=json_body(CreateSessionRequest))
    async def create_session(request: Request) -> Response:
        body = await parse_json_body(request, CreateSessionRequest)
        return json_response(gateway.create_session(body, str(request.base_url)).model_dump(), 201)

    @app.get("/sessions/{sid}")
    async def get_session(sid: str) -> Response:
        return Response(sessions.get(sid).record_json(), media_type="application/json")

    @app.post("/sessions/{sid}/finish", openapi_extra=json_body(FinishSessionRequest))
    async def finish_session(sid: str, request: Request) -> Response:
        body = await parse_json_body(request, FinishSessionRequest)
        return json_response((await sessions.finish(sid, body)).model_dump())

    @app.delete("/sessions/{sid}")
    async def delete_session(sid: str) -> Response:
        return json_response(sessions.abort(sessions.get(sid)).model_dump())

    @app.post("/sessions/{sid}/generate", openapi_extra=json_body(SessionGenerateRequest))
    async def generate(sid: str, request: Request) -> Response:
        body = await parse_json_body(request, SessionGenerateRequest)
        if body.stream:
            return error_reply(request, 400, "stream: the token-native endpoint does not stream; use chat/completions")
        return json_response(await gateway.turns.generate(sessions.open(sid), body, request))


def _model_routes(app: FastAPI, gateway: Gateway) -> None:
    """The OpenAI routes: by the session's base_url, or by its X-Session-Id header."""

    @app.post("/sessions/{sid}/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def session_chat(sid: str, request: Request) -> Response:
        return await gateway.chat(sid, await parse_json_body(request, ChatCompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def header_chat(request: Request) -> Response:
        sid = request.headers.get("x-session-id")
        if not sid:
            return error_reply(request, 400, "X-Session-Id header missing (or use {gateway}/sessions/{sid}/v1)")
        return await gateway.chat(sid, await parse_json_body(request, ChatCompletionRequest), request)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(gateway.models())

    @app.get("/sessions/{sid}/v1/models")
    async def session_models(sid: str) -> Response:
        gateway.sessions.get(sid)
        return json_response(gateway.models())


def parse_args(argv: Optional[list[str]] = None) -> tuple[GatewayConfig, Optional[str]]:
    """The gateway's section from --config FILE and/or its generated flags (--engine URL, --run NAME,
    --redis-url, --tokenizer, ...); the secrets by flag or environment; the --url-file."""
    p = argparse.ArgumentParser(prog="asyncrl gateway serve", description=__doc__.split("\n")[0])
    add_section_flags(p, GatewayConfig, FLAG_NAMES)
    p.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV),
                   help="require Authorization: Bearer <token> on every route, or the session's own api_key on its "
                        f"model routes (default ${TOKEN_ENV})")
    p.add_argument("--engine-api-key", default=os.environ.get(ENGINE_API_KEY_ENV),
                   help=f"the engines' --api-key, sent to them as a bearer token (default ${ENGINE_API_KEY_ENV})")
    p.add_argument("--url-file", help="write the bound URL here once serving")
    cfg, args = parse_section(p, GatewayConfig, argv)
    return replace(cfg, auth_token=args.auth_token, engine_api_key=args.engine_api_key), args.url_file


def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call otherwise
    cfg, url_file = parse_args(argv)
    template = GlmChatTemplate(load_tokenizer(cfg.tokenizer or BUILTIN_TINY), thinking=cfg.thinking)
    store = Store.connect(cfg.redis_url, cfg.run_name or "asyncrl") if cfg.redis_url else None
    if store is None:
        log.warning("no --redis-url: sessions cannot be finished (only aborted)")
    serve(build_app(cfg, template, store), cfg.host, cfg.port, url_file=url_file, keep_alive_s=CLIENT_KEEP_ALIVE_S,
          gc_sweep_s=cfg.gc_sweep_s)


if __name__ == "__main__":
    main()
