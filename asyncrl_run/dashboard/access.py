"""Who may read the dashboard: with a token set, every route but /health, /metrics and the login page wants
it, as `Authorization: Bearer <token>` (scripts, curl) or as the cookie the login page sets (a browser).

The token is `--auth-token`, else $ASYNCRL_DASHBOARD_TOKEN, else the run's orchestrator token
($ASYNCRL_ORCHESTRATOR_TOKEN, which the launcher hands its services: a dashboard started where the run was
started reads it), so whoever may drive the run's orchestrator may read its dashboard. Without any, the
dashboard is open, and binds loopback unless told otherwise (`--host`).

The cookie holds an HMAC of the token, not the token; it is HttpOnly and SameSite=Strict. A browser asking
for a page without it is sent to /login; an API request without it gets 401.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from http.cookies import CookieError, SimpleCookie
from typing import Callable, Optional

from asyncrl.service import GuardMiddleware

TOKEN_ENV = "ASYNCRL_DASHBOARD_TOKEN"
ORCHESTRATOR_TOKEN_ENV = "ASYNCRL_ORCHESTRATOR_TOKEN"
COOKIE = "asyncrl_dashboard"
OPEN_PATHS = ("/health", "/metrics", "/login")
PAGES = ("/", "/index.html")
"""Paths a browser navigates to: without credentials they redirect to the login page instead of a 401."""


def resolve_token(explicit: Optional[str]) -> Optional[str]:
    return explicit or os.environ.get(TOKEN_ENV) or os.environ.get(ORCHESTRATOR_TOKEN_ENV) or None


def cookie_value(token: str) -> str:
    return hmac.new(token.encode(), b"asyncrl-dashboard-session", hashlib.sha256).hexdigest()


def cookie_checker(token: str) -> Callable[[str, dict], bool]:
    """GuardMiddleware's `also_authorized`: the login cookie opens every route."""
    expected = cookie_value(token)

    def authorized(_path: str, headers: dict) -> bool:
        raw = headers.get(b"cookie", b"").decode("latin-1")
        try:
            jar = SimpleCookie(raw)
        except CookieError:
            return False
        morsel = jar.get(COOKIE)
        return morsel is not None and hmac.compare_digest(morsel.value, expected)

    return authorized


class DashboardGuard(GuardMiddleware):
    """GuardMiddleware (bearer token or cookie; /health, /metrics, /login open) that sends a browser asking
    for a page without credentials to the login page."""

    def __init__(self, app, auth_token: Optional[str], max_request_bytes: int = 64 * 1024) -> None:
        super().__init__(app, auth_token, max_request_bytes, open_prefixes=OPEN_PATHS,
                         also_authorized=cookie_checker(auth_token) if auth_token else None)

    async def _reply(self, send, path: str, status: int, message: str, extra_headers: list = ()) -> None:
        if status != 401 or path not in PAGES:
            return await super()._reply(send, path, status, message, extra_headers)
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", b"/login"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
