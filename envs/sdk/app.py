"""The HTTP app of an env service (docs/protocols/env-service.md). Handlers are thin: they map the
wire types onto the EpisodeRunner, which owns admission, deadlines and cancellation."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import orjson
from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncrl.protocols.fields import MAX_ID_CHARS
from asyncrl.service import GuardMiddleware, install_server_info
from envs.sdk.metrics import ServiceMetrics
from asyncrl.protocols.env_service import (CancelResponse, EpisodeRequest, EpisodeResponse, ErrorResponse,
                                           HealthResponse, InfoResponse, TasksResponse)
from envs.sdk.runner import AdmissionError, EpisodeRunner

DISCONNECT_POLL_S = 1.0
MAX_SPLIT_CHARS = 64
MAX_REQUEST_BYTES = 1 << 20
"""An episode request names its task and endpoint (a few hundred bytes): a larger body is refused (413)."""


OPEN_PATHS = ("/health", "/metrics")
"""Reached without the token (probes, Prometheus); every other route wants it when one is set."""


def create_app(runner: EpisodeRunner, metrics: ServiceMetrics, name: str, domain: str,
               auth_token: Optional[str] = None, section: Optional[Any] = None) -> FastAPI:
    """`section`: the config dataclass GET /server_info reports (secrets redacted)."""
    app = FastAPI(title=f"asyncrl env service {name}", docs_url=None, redoc_url=None)
    app.add_middleware(GuardMiddleware, auth_token=auth_token, max_request_bytes=MAX_REQUEST_BYTES,
                       error_body=_error_body, open_prefixes=OPEN_PATHS)
    if section is not None:
        install_server_info(app, section)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> HealthResponse:
        return HealthResponse()

    @app.get("/info")
    async def info() -> InfoResponse:
        return InfoResponse(name=name, domain=domain, capacity=runner.capacity, num_tasks=len(runner.task_ids),
                            version=runner.env.version, splits={k: len(v) for k, v in runner.splits.items()})

    @app.get("/tasks", responses={404: {"model": ErrorResponse}})
    async def tasks(offset: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=10_000),
                    split: str = Query("train", min_length=1, max_length=MAX_SPLIT_CHARS)):
        ids = runner.splits.get(split)
        if ids is None:
            return _error(404, f"env {name!r} has no {split!r} split (it serves: {', '.join(runner.splits)}); "
                               f"an env holds tasks out by listing 'eval' in Environment.splits (docs/envs.md)",
                          ["split"])
        return TasksResponse(task_ids=ids[offset:offset + limit], total=len(ids), split=split)

    @app.post("/episodes")
    async def episodes(req: EpisodeRequest, request: Request) -> EpisodeResponse:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, runner, req.episode_id))
        try:
            return await runner.run(req)
        finally:
            watcher.cancel()

    @app.post("/episodes/{episode_id}/cancel", responses={404: {"model": ErrorResponse}})
    async def cancel(episode_id: str = Path(max_length=MAX_ID_CHARS)):
        if not runner.cancel(episode_id):
            return _error(404, f"episode_id {episode_id!r} is not running")
        return CancelResponse(episode_id=episode_id, cancelled=True)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every refusal in the protocol's error shape: invalid fields (422, naming them), HTTP errors, admission."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        fields = [_field(err) for err in exc.errors()]
        details = "; ".join(f"{f}: {err['msg']}" for f, err in zip(fields, exc.errors()))
        return _error(422, f"invalid request: {details}", fields)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # 413 of a chunked body
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(AdmissionError)
    async def refused(_: Request, exc: AdmissionError) -> JSONResponse:
        return _error(exc.status_code, str(exc))


async def _cancel_on_disconnect(request: Request, runner: EpisodeRunner, episode_id: str) -> None:
    """A caller that hung up (timed out, re-dispatched elsewhere) no longer wants the episode."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    runner.cancel(episode_id)


def _field(err: dict) -> str:
    """Dotted path of the invalid field ('llm.base_url'), 'body' when the body as a whole is wrong."""
    loc = list(err.get("loc", ()))
    if err.get("type") == "json_invalid" or not loc:
        return "body"
    if loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    return ".".join(map(str, loc)) or "body"


def _error_body(_path: str, _status: int, message: str) -> bytes:
    return orjson.dumps(ErrorResponse(error=message).model_dump())


def _error(status: int, message: str, fields: list[str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=message, fields=fields or []).model_dump(), status_code=status)
