"""The bearer credential a client of a guarded asyncrl service sends (asyncrl.service.GuardMiddleware
checks it). Its own light module: the launcher and the CLIs send it without importing a web server."""

from __future__ import annotations

from typing import Optional


def bearer_headers(token: Optional[str]) -> dict[str, str]:
    """`Authorization: Bearer <token>`, or no header without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}
