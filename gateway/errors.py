"""The gateway's errors and their replies: OpenAI's shape under the OpenAI routes, asyncrl's elsewhere,
always naming what is wrong.

OpenAI clients read `{"error": {"message", "type", "code"}}` (the `openai` package puts the
message into the exception it raises); every other asyncrl route answers `{"error": "<message>"}`.
The exceptions that carry an HTTP status are defined here, not beside the code that raises them, so this
module imports nothing of the gateway and every module may raise them without climbing a floor.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from asyncrl.service import validation_message


class UnknownSessionError(LookupError):
    """404: no such session (never created, or finished long ago)."""


class SessionClosedError(RuntimeError):
    """409: the session is finished or aborted; no more turns."""


class NoEngineError(RuntimeError):
    """503: no healthy engine is left to run the turn."""


class EngineCredentialError(RuntimeError):
    """502: the engine refused the gateway's own credential (401/403): a misconfigured --engine-api-key, not
    the client's fault, so not a 400."""


class StoreUnavailableError(RuntimeError):
    """503: the trajectory cannot be written (no Redis configured, or Redis failed); retry finish."""


class ClientGoneError(Exception):
    """499: the client disconnected before its turn finished."""


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "conflict_error", 413: "request_too_large", 499: "client_closed_request",
               502: "bad_gateway", 503: "service_unavailable"}
STATUS_OF = ((UnknownSessionError, 404), (SessionClosedError, 409), (NoEngineError, 503), (EngineCredentialError, 502),
             (StoreUnavailableError, 503), (ValueError, 400))


def is_openai_route(path: str) -> bool:
    return path.startswith("/v1/") or "/v1/" in path and path.startswith("/sessions/")


def error_body(path: str, status: int, message: str) -> bytes:
    if is_openai_route(path):
        error = {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": None, "code": status}
        return orjson.dumps({"error": error})
    return orjson.dumps({"error": message, "code": status})


def error_reply(request: Request, status: int, message: str) -> Response:
    return Response(error_body(request.url.path, status, message), status_code=status, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return error_reply(request, 400, validation_message(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        return error_reply(request, exc.status_code, str(exc.detail))

    @app.exception_handler(ClientGoneError)
    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, __: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left

    for error, status in STATUS_OF:
        app.add_exception_handler(error, _reply_with(status))


def _reply_with(status: int) -> Callable[[Request, Exception], Awaitable[Response]]:
    """An exception handler answering `status` with the error's message. A coroutine: Starlette runs a
    plain function in its thread pool, a thread hop per error (and an import on the event loop at the first)."""

    async def reply(request: Request, exc: Exception) -> Response:
        return error_reply(request, status, str(exc))

    return reply
