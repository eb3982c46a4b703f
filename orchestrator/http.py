"""The orchestrator's HTTP client: one aiohttp session sized for thousands of held-open requests.

aiohttp rather than httpx: httpcore's pool re-scans every connection and queued request on each
request and response, which is quadratic work at thousands of held-open episode requests.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

import aiohttp
import orjson

JSON = {"Content-Type": "application/json"}
KEEPALIVE_S = 3.0
"""Idle pooled connections are closed after this long: under uvicorn's 5 s keep-alive, so the client,
not the server, closes them (a server-side close racing a reuse fails the request: measured at 4k in flight)."""


class SendClock:
    """Passed as trace context of an episode POST: calls `on_sent(seconds since ready)` once the
    request headers are written to the socket (the end of the scheduling-overhead interval)."""

    __slots__ = ("ready_at", "on_sent")

    def __init__(self, ready_at: float, on_sent: Callable[[float], None]) -> None:
        self.ready_at, self.on_sent = ready_at, on_sent


async def _headers_sent(_session, ctx, _params) -> None:
    clock = ctx.trace_request_ctx
    if isinstance(clock, SendClock):
        clock.on_sent(time.monotonic() - clock.ready_at)


def client_session(max_connections: int = 0) -> aiohttp.ClientSession:
    """0 = no connection limit (the scheduler already bounds requests in flight)."""
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_headers_sent)
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S,
                                     enable_cleanup_closed=True)
    return aiohttp.ClientSession(connector=connector, trace_configs=[trace], json_serialize=lambda o: orjson.dumps(o).decode())


class HTTPFailure(Exception):
    """A request that did not produce an answer: `unreachable` (no connection could be made: the
    server is down), `timed_out`, or the connection broke (reset, closed by a dying server)."""

    def __init__(self, message: str, timed_out: bool = False, unreachable: bool = False) -> None:
        super().__init__(message)
        self.timed_out, self.unreachable = timed_out, unreachable


async def request_json(http: aiohttp.ClientSession, method: str, url: str, body: Any = None,
                       timeout_s: float = 10.0, headers: Optional[dict] = None,
                       trace: Optional[SendClock] = None) -> tuple[int, Any]:
    """(status, decoded JSON body or None). Raises HTTPFailure when no answer came back."""
    data = orjson.dumps(body) if body is not None else None
    try:
        async with http.request(method, url, data=data, headers={**JSON, **(headers or {})},
                                timeout=aiohttp.ClientTimeout(total=timeout_s), trace_request_ctx=trace) as resp:
            raw = await resp.read()
    except asyncio.TimeoutError:
        raise HTTPFailure(f"{method} {url}: no answer within {timeout_s:g}s", timed_out=True) from None
    except aiohttp.ClientConnectorError as err:
        raise HTTPFailure(f"{method} {url}: cannot connect: {err.os_error}", unreachable=True) from None
    except (aiohttp.ClientError, OSError) as err:
        raise HTTPFailure(f"{method} {url}: {type(err).__name__}: {err}") from None
    try:
        return resp.status, orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return resp.status, {"error": raw[:200].decode(errors="replace")}
