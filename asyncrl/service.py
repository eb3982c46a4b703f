"""What every asyncrl HTTP service shares: binding (port 0 included), JSON errors, /metrics, /server_info,
SIGTERM, a guard (bearer token, request-size limit) and JSON bodies parsed off the event loop when large.

Each service builds its FastAPI app and calls `serve(app, host, port, url_file=...)`. The bound URL is
printed (`listening on http://127.0.0.1:PORT`; a wildcard bind prints the node's address, asyncrl.network) and optionally written to a file, so a parent that
asked for port 0 learns the port without races.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, TypeVar

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncrl.config import section_data
from asyncrl.gc_policy import SurvivorFreezer, freeze_startup_heap
from asyncrl.network import http_url

BaseModelT = TypeVar("BaseModelT", bound=BaseModel)

log = logging.getLogger("asyncrl.service")


OFFLOAD_JSON_BYTES = 256 * 1024
"""A JSON body larger than this is parsed and validated in a thread, so /health keeps answering."""


def error_content(status: int, message: str) -> dict[str, Any]:
    """The error body of every asyncrl service: {"error": message} (plus OpenAI-style fields)."""
    return {"error": message, "object": "error", "message": message, "code": status}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_content(status, message), status_code=status)


MAX_MESSAGE_PART = 300
"""Characters of one field's complaint: a message may quote the client's value, which is unbounded."""


def validation_message(exc: RequestValidationError) -> str:
    """One line naming each offending field, e.g. "sampling_params.temperature: must be >= 0". Pydantic's
    union branches (`SamplingParams`, `list[int]`: no JSON field is capitalised or bracketed) are left
    out of the path; each complaint is cut to MAX_MESSAGE_PART characters."""
    parts = []
    for err in exc.errors()[:10]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not _is_union_branch(p))
        part = f"{loc or 'body'}: {err.get('msg', 'invalid')}"
        parts.append(part if len(part) <= MAX_MESSAGE_PART else part[:MAX_MESSAGE_PART] + "...")
    return "; ".join(parts) or "invalid request"


def _is_union_branch(part: Any) -> bool:
    return isinstance(part, str) and (part[:1].isupper() or "[" in part)


async def parse_json_body(request: Request, model: type[BaseModelT]) -> BaseModelT:
    """Parse a JSON body whatever its Content-Type (curl -d sends form encoding), into `model`;
    malformed JSON and schema violations raise RequestValidationError (-> 400 naming the field).
    A large body is parsed in a thread (the event loop keeps serving meanwhile)."""
    raw = await request.body()
    if len(raw) > OFFLOAD_JSON_BYTES:
        return await asyncio.to_thread(parse_json, raw, model)
    return parse_json(raw, model)


def parse_json(raw: bytes, model: type[BaseModelT]) -> BaseModelT:
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


def install_server_info(app: FastAPI, section: Any) -> None:
    """GET /server_info: the service's effective config section (as SGLang's /server_info), secrets shown
    as "<set>", so a run can check what each service actually runs with."""
    info = section_data(section, redact=True)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return info


ASGIApp = Callable[..., Any]
ErrorBody = Callable[[str, int, str], bytes]
"""(path, status, message) -> the service's JSON error body."""


def default_error_body(_path: str, status: int, message: str) -> bytes:
    return orjson.dumps(error_content(status, message))


class GuardMiddleware:
    """ASGI middleware in front of every route: optional bearer token (401) and request-size limit (413).

    Plain ASGI rather than Starlette's BaseHTTPMiddleware: it adds microseconds, not a task per request.
    The size limit checks Content-Length up front and counts the bytes of chunked bodies as they come
    (raising HTTPException 413 inside the app, whose error handler answers). `open_prefixes`: paths
    that need no token (SGLang's --api-key leaves /health* and /metrics open, and CORS preflights);
    `also_authorized(path, headers)`: a second way in when the token does not match (the gateway's
    per-session credentials, which open their own session's routes only); `route_limits`: per-path
    size limits replacing `max_request_bytes` (None: unlimited)."""

    def __init__(self, app: ASGIApp, auth_token: Optional[str], max_request_bytes: int,
                 error_body: ErrorBody = default_error_body, open_prefixes: tuple[str, ...] = (),
                 route_limits: Mapping[str, Optional[int]] = {},
                 also_authorized: Optional[Callable[[str, dict], bool]] = None) -> None:
        self.app = app
        self.expected = f"Bearer {auth_token}".encode() if auth_token else None
        self.max_request_bytes = max_request_bytes
        self.error_body = error_body
        self.open_prefixes = open_prefixes
        self.route_limits = dict(route_limits)
        self.also_authorized = also_authorized

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.expected is not None and not self._open(scope) and not self._authorized(path, headers):
            return await self._reply(send, path, 401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                                     [(b"www-authenticate", b"Bearer")])
        limit = self.route_limits.get(path, self.max_request_bytes)
        if limit is None:
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._reply(send, path, 413, f"request body of {int(length)} bytes exceeds {limit}")
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # the app's error handler answers 413
                    raise StarletteHTTPException(413, f"request body exceeds {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)

    def _authorized(self, path: str, headers: dict) -> bool:
        if hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return True
        return self.also_authorized is not None and self.also_authorized(path, headers)

    def _open(self, scope: dict) -> bool:
        """With open prefixes (SGLang's semantics), those paths and CORS preflights need no token."""
        if not self.open_prefixes:
            return False
        return scope["method"] == "OPTIONS" or scope["path"].startswith(self.open_prefixes)

    async def _reply(self, send: Callable, path: str, status: int, message: str, extra_headers: list = ()) -> None:
        body = self.error_body(path, status, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *extra_headers]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def bind_socket(host: str, port: int) -> socket.socket:
    # proto IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # accepted sockets inherit it. Without it every response waits ~40 ms (Nagle + delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(app: FastAPI, host: str, port: int, url_file: Optional[str] = None, log_level: str = "warning",
          keep_alive_s: float = 5.0, gc_sweep_s: float = 0.0) -> None:
    """Serve until SIGINT/SIGTERM: stop accepting, finish in-flight requests, run the app's shutdown,
    exit 0. (uvicorn re-raises the signal after its graceful shutdown; the no-op handlers installed
    here absorb that, so a clean stop is not reported as death by signal.) `keep_alive_s`: how long an
    idle client connection stays open (uvicorn's default 5 s; longer for clients that pause between
    calls, so they rarely race a closing connection). `gc_sweep_s` > 0: for a process whose latency tail was
    the cyclic GC walking many long-lived objects (the control plane), asyncrl.gc_policy.SurvivorFreezer,
    sweeping every that many seconds."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    sock = bind_socket(host, port)
    url = http_url(host, sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10,
                                           limit_concurrency=None, backlog=4096, timeout_keep_alive=keep_alive_s))

    async def run() -> None:
        serve_task = asyncio.create_task(server.serve(sockets=[sock]))
        if gc_sweep_s > 0:
            freezer = SurvivorFreezer(gc_sweep_s)
            freezer.install()
            sweeper = asyncio.create_task(freezer.sweep_forever())
            serve_task.add_done_callback(lambda _: sweeper.cancel())
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.01)
        if server.started:
            print(f"listening on {url}", flush=True)
            if url_file:
                tmp = Path(url_file).with_suffix(".tmp")
                tmp.write_text(url)
                tmp.replace(url_file)
        await serve_task

    freeze_startup_heap()
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
