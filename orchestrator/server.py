"""`asyncrl orchestrator serve`: the orchestrator's HTTP API (docs/protocols/orchestrator.md).

Handlers are thin: parse the typed request, call the Orchestrator, reply with a typed response.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from contextlib import asynccontextmanager
from typing import Annotated, AsyncIterator, Optional

from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from asyncrl.config import DynamicSamplingConfig, OrchestratorConfig, SamplingConfig
from asyncrl.protocols.env_service import SERVICE_TOKEN_ENV
from asyncrl.protocols.orchestrator import (EnvRecord, HeartbeatRequest, HeartbeatResponse, PauseResponse,
                                            RegisterRequest, RegisterResponse, RemoveResponse, StatusResponse)
from asyncrl.service import GuardMiddleware, install_error_handlers, json_body, parse_json_body, serve
from orchestrator.core import Orchestrator
from orchestrator.runtime import Runtime

log = logging.getLogger("orchestrator.server")

TOKEN_ENV = "ASYNCRL_ORCHESTRATOR_TOKEN"
MAX_REQUEST_BYTES = 1 << 20
"""Registrations and heartbeats are a few hundred bytes: a larger body is refused (413) unread."""
OPEN_PATHS = ("/health", "/metrics")
"""What a prober reaches without the token (as the engine's --api-key); every /v1 route needs it."""
EnvId = Annotated[str, Path(max_length=64, description="as POST /v1/envs returned it (env-<12 hex>)")]
"""Bounded, so the 404 that names an unknown one stays short."""


def build_app(cfg: OrchestratorConfig, redis_url: str, run: str) -> FastAPI:
    runtime = Runtime(cfg, redis_url, run)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.orch = await runtime.start()
        yield
        await runtime.stop()

    app = FastAPI(title="asyncrl orchestrator", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(GuardMiddleware, auth_token=cfg.auth_token, max_request_bytes=MAX_REQUEST_BYTES,
                       open_prefixes=OPEN_PATHS)
    install_error_handlers(app)

    def orch(request: Request) -> Orchestrator:
        return request.app.state.orch

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(orch(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/envs", status_code=201, openapi_extra=json_body(RegisterRequest))
    async def register(request: Request) -> RegisterResponse:
        body = await parse_json_body(request, RegisterRequest)
        service = await orch(request).register(body)
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

    @app.get("/v1/status")
    async def status(request: Request, overhead_since: Optional[float] = Query(None, ge=0, allow_inf_nan=False)
                     ) -> StatusResponse:
        """`overhead_since` (unix time): summarise the dispatches made after it (default: the last rate_window_s)."""
        return orch(request).status(overhead_since)

    @app.post("/v1/pause")
    async def pause(request: Request) -> PauseResponse:
        orch(request).pause(True)
        return PauseResponse(paused=True, pause_reasons=orch(request).pause_reasons)

    @app.post("/v1/resume")
    async def resume(request: Request) -> PauseResponse:
        orch(request).pause(False)
        return PauseResponse(paused=bool(orch(request).pause_reasons), pause_reasons=orch(request).pause_reasons)

    return app


def _ratios(text: str) -> dict[str, float]:
    """'swe=2,terminal=1' -> {'swe': 2.0, 'terminal': 1.0}"""
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {part!r}")
        out[key.strip()] = float(value)
    return out


def _turns(text: str) -> dict[str, int]:
    """'swe=50,search=10' -> {'swe': 50, 'search': 10}"""
    out = {}
    for key, value in _ratios(text).items():
        if not value.is_integer() or value < 1:
            raise argparse.ArgumentTypeError(f"max turns of {key!r} must be a whole number >= 1, got {value:g}")
        out[key] = int(value)
    return out


def _deadlines(text: str) -> dict[str, float]:
    """'swe=1800,search=120' -> {'swe': 1800.0, 'search': 120.0}"""
    out = _ratios(text)
    for key, value in out.items():
        if not value > 0:
            raise argparse.ArgumentTypeError(f"the episode timeout of {key!r} must be > 0 seconds, got {value:g}")
    return out


def _sampling(text: str) -> SamplingConfig:
    try:
        return SamplingConfig(**json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError) as err:  # TypeError: a key SamplingConfig lacks
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv: Optional[list[str]] = None) -> tuple[OrchestratorConfig, argparse.Namespace]:
    d = OrchestratorConfig()
    p = argparse.ArgumentParser(prog="asyncrl orchestrator serve", description=__doc__.split("\n")[0])
    p.add_argument("--redis-url", required=True, help="Redis of the run (state, groups stream)")
    p.add_argument("--run", default="asyncrl", help="run name (Redis key prefix asyncrl:<run>:)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port (see --url-file)")
    p.add_argument("--url-file", help="write the bound URL here once serving")
    p.add_argument("--gateway", dest="gateway_url", help="TITO gateway URL (sessions=gateway)")
    p.add_argument("--gateway-token", default=os.environ.get("ASYNCRL_GATEWAY_TOKEN"))
    p.add_argument("--env-token", default=os.environ.get(SERVICE_TOKEN_ENV),
                   help=f"bearer token sent to env services (default ${SERVICE_TOKEN_ENV})")
    p.add_argument("--llm-url", help="OpenAI-compatible base URL for every episode (sessions=endpoint: "
                                     "nothing recorded; evaluation and benchmarks)")
    p.add_argument("--auth-token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (default ${TOKEN_ENV})")
    for name in ("max_in_flight", "group_size", "max_attempts", "max_turns", "max_unconsumed_groups",
                 "groups_per_step", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--staleness-limit", type=int, default=None)
    p.add_argument("--max-groups", type=int, default=None, help="start this many groups, then only finish them")
    for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "episode_timeout_s", "request_grace_s",
                 "backpressure_interval_s", "lease_ttl_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--weights", type=_ratios, default={}, help="env or domain weights, e.g. swe=2,terminal=1,search=1")
    p.add_argument("--rate-limits", type=_ratios, default={}, help="episodes/s per env, e.g. swe=5")
    p.add_argument("--max-turns-by-env", type=_turns, default={},
                   help="max_turns of one env's episodes by env name or domain, e.g. swe=50,search=10")
    p.add_argument("--episode-timeout-s-by-env", type=_deadlines, default={},
                   help="deadline_s of one env's episodes by env name or domain, e.g. swe=1800")
    p.add_argument("--sampling", type=_sampling, default=SamplingConfig(),
                   help='the run\'s sampling config as JSON, every field of asyncrl.config.SamplingConfig '
                        '(missing ones keep their default), e.g. \'{"temperature": 0.7, "max_new_tokens": 64}\'')
    ds = d.dynamic_sampling
    p.add_argument("--dynamic-sampling", action="store_true",
                   help="filter complete groups whose rewards are all equal (DAPO); docs/orchestrator.md")
    p.add_argument("--dynamic-sampling-std-tol", type=float, default=ds.std_tol,
                   help="a group with reward std <= this is uninformative (default: exactly equal rewards)")
    p.add_argument("--dynamic-sampling-max-filtered-batches", type=int, default=ds.max_filtered_batches,
                   help="after this many x groups-per-step groups filtered in a row, deliver uninformative "
                        "groups until an informative one comes (0: never)")
    p.add_argument("--model-name", default=d.model_name)
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    if bool(a.gateway_url) == bool(a.llm_url):
        p.error("give exactly one of --gateway (record trajectories) or --llm-url (evaluation/benchmarks)")
    cfg = OrchestratorConfig(
        host=a.host, port=a.port, auth_token=a.auth_token, sessions="gateway" if a.gateway_url else "endpoint",
        gateway_url=a.gateway_url, gateway_token=a.gateway_token, env_token=a.env_token, llm_url=a.llm_url, model_name=a.model_name,
        sampling=a.sampling,
        dynamic_sampling=DynamicSamplingConfig(enabled=a.dynamic_sampling, std_tol=a.dynamic_sampling_std_tol,
                                               max_filtered_batches=a.dynamic_sampling_max_filtered_batches),
        domain_weights=a.weights, rate_limits=a.rate_limits, staleness_limit=a.staleness_limit, max_groups=a.max_groups,
        max_turns_by_env=a.max_turns_by_env, episode_timeout_s_by_env=a.episode_timeout_s_by_env,
        **{k: getattr(a, k) for k in ("max_in_flight", "group_size", "max_attempts", "max_turns", "seed",
                                       "max_unconsumed_groups", "groups_per_step", "heartbeat_interval_s",
                                       "heartbeat_timeout_s", "episode_timeout_s", "request_grace_s",
                                       "backpressure_interval_s", "lease_ttl_s")})
    return cfg, a


def main(argv: Optional[list[str]] = None) -> None:
    cfg, args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    use_uvloop()
    serve(build_app(cfg, args.redis_url, args.run), cfg.host, cfg.port, url_file=args.url_file)


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
