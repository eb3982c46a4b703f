"""`asyncrl orchestrator serve`: the orchestrator's HTTP API (docs/protocols/orchestrator.md).

Handlers are thin: parse the typed request, call the Orchestrator, reply with a typed response.
Configured by `--config FILE` (the section the launcher writes) and/or flags generated from
OrchestratorConfig (asyncrl.section_flags); GET /server_info reports the effective config.
"""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Annotated, AsyncIterator, Optional

from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from asyncrl.config import OrchestratorConfig
from asyncrl.protocols.env_service import SERVICE_TOKEN_ENV
from asyncrl.protocols.orchestrator import (EnvRecord, HeartbeatRequest, HeartbeatResponse, PauseResponse,
                                            RegisterRequest, RegisterResponse, RemoveResponse, StatusResponse)
from asyncrl.section_flags import add_section_flags, parse_section
from asyncrl.service import (GuardMiddleware, install_error_handlers, install_server_info, json_body,
                             parse_json_body, serve)
from orchestrator.core import Orchestrator
from orchestrator.runtime import Runtime
from orchestrator.sessions import SESSION_PROVIDERS

log = logging.getLogger("orchestrator.server")

TOKEN_ENV = "ASYNCRL_ORCHESTRATOR_TOKEN"
GATEWAY_TOKEN_ENV = "ASYNCRL_GATEWAY_TOKEN"
MAX_REQUEST_BYTES = 1 << 20
"""Registrations and heartbeats are a few hundred bytes: a larger body is refused (413) unread."""
OPEN_PATHS = ("/health", "/metrics")
"""What a prober reaches without the token (as the engine's --api-key); every /v1 route needs it."""
EnvId = Annotated[str, Path(max_length=64, description="as POST /v1/envs returned it (env-<12 hex>)")]
"""Bounded, so the 404 that names an unknown one stays short."""
FLAG_NAMES = {"run_name": "--run", "gateway_url": "--gateway", "domain_weights": "--weights",
              "dynamic_sampling.enabled": "--dynamic-sampling"}
"""Fields whose flag is not the generated --field-name (asyncrl.section_flags)."""


def build_app(cfg: OrchestratorConfig) -> FastAPI:
    runtime = Runtime(cfg, cfg.redis_url, cfg.run_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.orch = await runtime.start()
        yield
        await runtime.stop()

    app = FastAPI(title="asyncrl orchestrator", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(GuardMiddleware, auth_token=cfg.auth_token, max_request_bytes=MAX_REQUEST_BYTES,
                       open_prefixes=OPEN_PATHS)
    install_error_handlers(app)
    install_server_info(app, cfg)
    _env_routes(app, cfg)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(orch(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def status(request: Request, overhead_since: Optional[float] = Query(None, ge=0, allow_inf_nan=False)
                     ) -> StatusResponse:
        """`overhead_since` (unix time): summarise the dispatches made after it (default: the last rate_window_s)."""
        return orch(request).status(overhead_since)

    @app.post("/v1/pause")
    async def pause(request: Request) -> PauseResponse:
        return orch(request).pause(True)

    @app.post("/v1/resume")
    async def resume(request: Request) -> PauseResponse:
        return orch(request).pause(False)

    return app


def orch(request: Request) -> Orchestrator:
    return request.app.state.orch


def _env_routes(app: FastAPI, cfg: OrchestratorConfig) -> None:
    """Env services register, heartbeat and leave (docs/protocols/orchestrator.md)."""

    @app.post("/v1/envs", status_code=201, openapi_extra=json_body(RegisterRequest))
    async def register(request: Request) -> RegisterResponse:
        service = await orch(request).register(await parse_json_body(request, RegisterRequest))
        return RegisterResponse(env_id=service.env_id, heartbeat_interval_s=cfg.heartbeat_interval_s,
                                heartbeat_timeout_s=cfg.heartbeat_timeout_s)

    @app.get("/v1/envs")
    async def list_envs(request: Request) -> list[EnvRecord]:
        return [s.to_record() for s in orch(request).registry]

    @app.post("/v1/envs/{env_id}/heartbeat", openapi_extra=json_body(HeartbeatRequest))
    async def heartbeat(env_id: EnvId, request: Request) -> HeartbeatResponse:
        service = orch(request).heartbeat(env_id, await parse_json_body(request, HeartbeatRequest))
        if service is None:
            raise HTTPException(404, f"unknown env_id {env_id!r}: register again")
        return HeartbeatResponse(env_id=env_id, healthy=service.healthy)

    @app.delete("/v1/envs/{env_id}")
    async def remove(env_id: EnvId, request: Request) -> RemoveResponse:
        removed = await orch(request).remove(env_id)
        if removed is None:
            raise HTTPException(404, f"unknown env_id {env_id!r}")
        return RemoveResponse(env_id=env_id, removed=True, draining=removed[1])


def parse_args(argv: Optional[list[str]] = None) -> tuple[OrchestratorConfig, argparse.Namespace]:
    """The orchestrator's section from --config FILE and/or its generated flags (--redis-url, --run,
    --gateway or --llm-url, --group-size, ...); the secrets by flag or environment."""
    p = argparse.ArgumentParser(prog="asyncrl orchestrator serve", description=__doc__.split("\n")[0])
    add_section_flags(p, OrchestratorConfig, FLAG_NAMES)
    p.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (default ${TOKEN_ENV})")
    p.add_argument("--gateway-token", default=os.environ.get(GATEWAY_TOKEN_ENV),
                   help=f"bearer token sent to the gateway (default ${GATEWAY_TOKEN_ENV})")
    p.add_argument("--env-token", default=os.environ.get(SERVICE_TOKEN_ENV),
                   help=f"bearer token sent to env services (default ${SERVICE_TOKEN_ENV})")
    p.add_argument("--url-file", help="write the bound URL here once serving")
    p.add_argument("--log-level", default="INFO")
    cfg, a = parse_section(p, OrchestratorConfig, argv)
    if not cfg.redis_url:
        p.error("the run's Redis is required: --redis-url (or redis_url in --config)")
    if bool(cfg.gateway_url) == bool(cfg.llm_url):
        p.error("give exactly one of --gateway (record trajectories) or --llm-url (evaluation/benchmarks)")
    bad = [f"max_turns_by_env {k}={v}" for k, v in cfg.max_turns_by_env.items() if v < 1] + [
        f"episode_timeout_s_by_env {k}={v}" for k, v in cfg.episode_timeout_s_by_env.items() if not v > 0]
    if bad:
        p.error(f"{', '.join(bad)}: per-env max turns must be >= 1 and timeouts > 0 seconds")
    if cfg.sessions in SESSION_PROVIDERS:  # a built-in follows the URL given; a provider of one's own is kept
        cfg = replace(cfg, sessions="gateway" if cfg.gateway_url else "endpoint")
    return replace(cfg, auth_token=a.auth_token,
                   gateway_token=a.gateway_token, env_token=a.env_token), a


def main(argv: Optional[list[str]] = None) -> None:
    cfg, args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    use_uvloop()
    serve(build_app(cfg), cfg.host, cfg.port, url_file=args.url_file, gc_sweep_s=cfg.gc_sweep_s)


def use_uvloop() -> None:
    """uvloop roughly halves the event loop's cost per request when installed (it ships with uvicorn[standard])."""
    try:
        import asyncio

        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        log.info("uvloop not installed; using the default asyncio loop")


if __name__ == "__main__":
    main()
