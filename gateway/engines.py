"""The engines the gateway routes over: one EngineClient each, in-flight counts, health.

An engine is marked unhealthy the moment a request to it fails at the transport level (or with a
5xx), or after HEALTH_FAILURES_TO_DROP periodic /health checks in a row fail (one slow answer from
an engine busy with a thousand requests is not a death); it is healthy again when /health answers
200. Routing skips unhealthy engines (router.py), so a failed engine's sessions move to the others
on their next call. A healthy engine that answered a call within the last health interval is not probed:
that answer is the check (passive health, as a proxy's outlier detection reads its traffic), so under load
the rounds cost nothing; only when no healthy engine is left does a turn try the unhealthy ones, and then
wait for one to come back (`wait_healthy`: a restarted engine, at its old URL or a new one from the
registry).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Optional

import httpx
import redis.exceptions

from asyncrl.engine_client import AiohttpTransport, EngineClient
from asyncrl.protocols.gateway import EngineStatus
from gateway.router import HashRing, pick_bounded

log = logging.getLogger("gateway.engines")

HEALTH_FAILURES_TO_DROP = 3
HEALTH_TIMEOUT_S = 10.0


@dataclass
class EngineState:
    url: str
    client: EngineClient
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    failed_checks: int = 0
    """Consecutive failed health checks."""
    answered_at: float = float("-inf")
    """time.monotonic() of its last successful call: a health check within an interval of it is skipped."""
    last_error: str = field(default="", repr=False)

    def status(self) -> EngineStatus:
        return EngineStatus(url=self.url, healthy=self.healthy, in_flight=self.in_flight, requests=self.requests,
                            failures=self.failures)


class EnginePool:
    def __init__(self, urls: Iterable[str], timeout_s: float, load_factor: float, health_interval_s: float,
                 virtual_nodes: int = 100, registry: Optional[Callable[[], Awaitable[dict[str, str]]]] = None,
                 api_key: Optional[str] = None, balance_abs_threshold: int = 0) -> None:
        """`registry`: when given, the engine set follows it (engine_id -> URL) at every health round.
        `api_key`: the engines' --api-key. `balance_abs_threshold`: the bounded-load slack (router.pick_bounded)."""
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.registry = registry
        self.load_factor = load_factor
        self.balance_abs_threshold = balance_abs_threshold
        self.health_interval_s = health_interval_s
        # One connection pool for every engine (aiohttp for unary calls, the hot path; httpx for
        # streams); no retries inside the client: the gateway fails over itself.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=2048))
        self.transport = AiohttpTransport(connect_timeout_s=5.0)
        self.engines: dict[str, EngineState] = {}
        self.ring = HashRing(virtual_nodes=virtual_nodes)
        self._health_task: Optional[asyncio.Task] = None
        self._healthy_again = asyncio.Event()
        """Set (and replaced) whenever an engine becomes healthy or joins: wakes the turns in wait_healthy."""
        self.set_engines(urls)

    def set_engines(self, urls: Iterable[str]) -> None:
        """Route over exactly `urls` from now on (calls already running on a removed engine finish)."""
        urls = [url.rstrip("/") for url in urls]
        joined = set(urls) - set(self.engines)
        self.engines = {url: self.engines.get(url) or EngineState(url, self._client(url)) for url in urls}
        self.ring.set_nodes(urls)
        if joined:
            self._wake()

    def _client(self, url: str) -> EngineClient:
        return EngineClient(url, timeout_s=self.timeout_s, retries=0, client=self.http, transport=self.transport,
                            api_key=self.api_key)

    def pick(self, session_id: str, exclude: frozenset[str] = frozenset()) -> Optional[EngineState]:
        """The session's engine by the bounded-load ring over healthy engines; if none is healthy,
        over the others not in `exclude` (a last resort: health marks can be stale)."""
        load = lambda u: self.engines[u].in_flight  # noqa: E731
        bounds = self.load_factor, exclude, self.balance_abs_threshold
        url = pick_bounded(self.ring, session_id, load, lambda u: self.engines[u].healthy, *bounds) \
            or pick_bounded(self.ring, session_id, load, lambda u: True, *bounds)
        return None if url is None else self.engines[url]

    @staticmethod
    def mark_answered(engine: EngineState) -> None:
        """A call to `engine` succeeded: it counts as a passed health check for the next interval."""
        engine.answered_at = time.monotonic()

    def mark_failed(self, engine: EngineState, error: str) -> None:
        engine.failures += 1
        engine.last_error = error
        if engine.healthy:
            log.warning("engine %s marked unhealthy: %s", engine.url, error)
        engine.healthy = False

    def status(self) -> list[EngineStatus]:
        return [engine.status() for engine in self.engines.values()]

    @property
    def any_healthy(self) -> bool:
        return any(engine.healthy for engine in self.engines.values())

    async def wait_healthy(self, timeout_s: float) -> bool:
        """Until some engine is healthy (True) or `timeout_s` passed (False)."""
        if not self.any_healthy:
            try:
                await asyncio.wait_for(self._healthy_again.wait(), max(timeout_s, 0.0))
            except TimeoutError:
                pass
        return self.any_healthy

    def _wake(self) -> None:
        self._healthy_again.set()
        self._healthy_again = asyncio.Event()

    # Health ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._health_task = asyncio.create_task(self._health_loop())

    async def check_health(self, spread_s: float = 0.0) -> None:
        """One /health round over the engines; `spread_s` > 0 starts one check every `spread_s / n` seconds
        (64 checks started at once held the event loop ~35 ms every round: a tail for every turn then in
        flight). Each result applies as it comes."""
        engines = list(self.engines.values())
        step = spread_s / max(len(engines), 1)
        checks: list[asyncio.Task] = []
        try:
            for i, engine in enumerate(engines):
                if i and step:
                    await asyncio.sleep(step)
                checks.append(asyncio.create_task(self._check(engine)))
            await asyncio.gather(*checks)
        finally:  # a round cancelled mid-spread (close) leaves no check running against a closed client
            for check in checks:
                check.cancel()

    async def _check(self, engine: EngineState) -> None:
        if engine.healthy and time.monotonic() - engine.answered_at < self.health_interval_s:
            engine.failed_checks = 0  # it answered a call since the last round (passive health)
            return
        ok = await engine.client.health(timeout_s=HEALTH_TIMEOUT_S)
        engine.failed_checks = 0 if ok else engine.failed_checks + 1
        if ok and not engine.healthy:
            log.info("engine %s healthy again", engine.url)
            engine.healthy = True
            self._wake()
        elif engine.healthy and engine.failed_checks >= HEALTH_FAILURES_TO_DROP:
            log.warning("engine %s failed %d health checks in a row", engine.url, engine.failed_checks)
            engine.healthy = False

    async def follow_registry(self) -> None:
        urls = sorted(set((await self.registry()).values()))
        if urls and set(urls) != set(self.engines):
            log.info("engine registry changed: routing over %s", urls)
            self.set_engines(urls)

    async def _health_loop(self) -> None:
        while True:
            try:
                if self.registry is not None:
                    await self.follow_registry()
            except (redis.exceptions.RedisError, OSError) as err:  # a Redis hiccup: keep the current set
                log.warning("reading the engine registry failed (%r); routing over the engines known", err)
            except Exception:
                log.exception("reading the engine registry failed")
            round_ends = time.monotonic() + self.health_interval_s
            try:
                await self.check_health(spread_s=self.health_interval_s)
            except Exception:  # keep checking whatever one round hit
                log.exception("health check round failed")
            await asyncio.sleep(max(round_ends - time.monotonic(), 0.0))

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.http.aclose()
        await self.transport.close()
