"""ASGI middleware in front of every route: optional bearer token (401) and request-size limit (413).

Plain ASGI rather than Starlette's BaseHTTPMiddleware: it adds microseconds, not a task per request.
A request the token does not open may still pass `also_authorized(path, headers)`: the gateway's
per-session credentials (gateway/sessions.py), which open their own session's routes only.
The size limit checks Content-Length up front and counts the bytes of chunked bodies as they come
(raising HTTPException 413 inside the app, whose error handler answers).
"""

from __future__ import annotations

import hmac
from typing import Any, Callable, Optional

from starlette.exceptions import HTTPException

from gateway.errors import error_body

ASGIApp = Callable[..., Any]


class GuardMiddleware:
    def __init__(self, app: ASGIApp, auth_token: Optional[str], max_request_bytes: int,
                 also_authorized: Optional[Callable[[str, dict], bool]] = None) -> None:
        self.app = app
        self.expected = f"Bearer {auth_token}".encode() if auth_token else None
        self.also_authorized = also_authorized
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and not self._authorized(scope["path"], headers):
            return await _reply(send, scope["path"], 401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                                [(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return await _reply(send, scope["path"], 413, f"request body of {int(length)} bytes exceeds {self.max_request_bytes}")
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:  # the app's error handler answers 413
                    raise HTTPException(413, f"request body exceeds {self.max_request_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)

    def _authorized(self, path: str, headers: dict) -> bool:
        if hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return True
        return self.also_authorized is not None and self.also_authorized(path, headers)


async def _reply(send: Callable, path: str, status: int, message: str, extra_headers: list = ()) -> None:
    body = error_body(path, status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
