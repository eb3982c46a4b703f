"""What every asyncrl HTTP service shares: binding (port 0 included), JSON errors, /metrics, SIGTERM.

Each service builds its FastAPI app and calls `serve(app, host, port, url_file=...)`. The bound URL is
printed (`listening on http://127.0.0.1:PORT`) and optionally written to a file, so a parent that
asked for port 0 learns the port without races.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from pathlib import Path
from typing import Any, Optional, TypeVar

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

BaseModelT = TypeVar("BaseModelT", bound=BaseModel)

log = logging.getLogger("asyncrl.service")


def error_response(status: int, message: str) -> JSONResponse:
    """The error body of every asyncrl service: {"error": message} (plus OpenAI-style fields)."""
    return JSONResponse({"error": message, "object": "error", "message": message, "code": status}, status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    """One line naming each offending field, e.g. "sampling_params.temperature: must be >= 0"."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


async def parse_json_body(request: Request, model: type[BaseModelT]) -> BaseModelT:
    """Parse a JSON body whatever its Content-Type (curl -d sends form encoding), into `model`;
    malformed JSON and schema violations raise RequestValidationError (-> 400 naming the field)."""
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise RequestValidationError([{"loc": ("body",), "msg": f"malformed JSON: {err}"}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route whose handler reads its body with parse_json_body: publishes `model`'s
    JSON schema as the route's requestBody (FastAPI sees no typed body parameter, so it would publish
    none), for schema-driven clients and fuzzers. The schema is self-contained (its $defs inlined)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": _inline_refs(schema, definitions, ())}}}}


def _inline_refs(node: Any, definitions: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline_refs(item, definitions, seen) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].removeprefix("#/$defs/")
        if name in seen:
            raise ValueError(f"{name} is recursive: its schema cannot be inlined")
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return _inline_refs({**definitions[name], **rest}, definitions, (*seen, name))
    return {k: _inline_refs(v, definitions, seen) for k, v in node.items()}


def install_error_handlers(app: FastAPI) -> None:
    """Schema violations and malformed JSON -> 400 with the field named; HTTPException -> its status."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))


def install_metrics(app: FastAPI, registry: CollectorRegistry) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def bind_socket(host: str, port: int) -> socket.socket:
    # proto IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # accepted sockets inherit it. Without it every response waits ~40 ms (Nagle + delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(app: FastAPI, host: str, port: int, url_file: Optional[str] = None, log_level: str = "warning",
          keep_alive_s: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM: stop accepting, finish in-flight requests, run the app's shutdown,
    exit 0. (uvicorn re-raises the signal after its graceful shutdown; the no-op handlers installed
    here absorb that, so a clean stop is not reported as death by signal.) `keep_alive_s`: how long an
    idle client connection stays open (uvicorn's default 5 s; longer for clients that pause between
    calls, so they rarely race a closing connection)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    sock = bind_socket(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10,
                                           limit_concurrency=None, backlog=4096, timeout_keep_alive=keep_alive_s))

    async def run() -> None:
        serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.01)
        if server.started:
            print(f"listening on {url}", flush=True)
            if url_file:
                tmp = Path(url_file).with_suffix(".tmp")
                tmp.write_text(url)
                tmp.replace(url_file)
        await serve_task

    with asyncio.Runner(loop_factory=_fast_loop_factory()) as runner:
        runner.run(run())
    log.info("%s stopped", url)


def _fast_loop_factory():
    """uvloop's event loop when installed (what `uvicorn.run` picks too), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
