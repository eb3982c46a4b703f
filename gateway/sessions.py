"""The gateway's state: open sessions, finish replies, the engine pool, the Redis store.

Lifecycle of a session: created (POST /sessions) -> turns -> finished once (reward, status), which
appends its segments to Redis unless aborted -> its record stays readable for
`finished_session_ttl_s`, its finish reply (idempotency) for the last `max_finish_replies` sessions.
Open sessions idle for `session_idle_timeout_s` are aborted, so memory stays bounded.

With an auth token, each session gets its own credential at creation (`api_key` of the reply): it opens
that session's model routes only (`SESSION_ROUTES`), and only while the session is active, so an env's
agent can neither reach other sessions nor the admin routes (finish, engines), nor keep using a finished one.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from collections import OrderedDict
from typing import Optional

import orjson
import redis.exceptions

from asyncrl.config import GatewayConfig
from asyncrl.protocols.gateway import CreateSessionRequest, FinishSessionRequest, FinishSessionResponse
from asyncrl.store import Store
from gateway.errors import StoreUnavailableError, UnknownSessionError
from gateway.generation import TurnRunner
from gateway.metrics import GatewayMetrics
from gateway.recorder import record_session
from gateway.session_ledger import Session

log = logging.getLogger("gateway.sessions")


SESSION_ROUTES = re.compile(r"/sessions/([^/]+)/(?:v1/.*|generate)")
"""The routes a session credential opens: its OpenAI base_url's and the token-native turn."""
HEADER_ROUTE = "/v1/chat/completions"
"""Chat addressed by the X-Session-Id header: opened by that session's credential too."""


class SessionRegistry:
    def __init__(self, cfg: GatewayConfig, runner: TurnRunner, store: Optional[Store], metrics: GatewayMetrics,
                 max_finish_replies: int = 200_000) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.runner = runner
        self.store = store
        self.sessions: dict[str, Session] = {}
        self.finish_replies: OrderedDict[str, bytes] = OrderedDict()
        """session id -> its finish reply as JSON: bytes, which the GC does not walk (200,000 replies as
        objects would be 800,000 for every full collection to visit)."""
        self.max_finish_replies = max_finish_replies
        self._background: set[asyncio.Task] = set()

    @property
    def active(self) -> int:
        return sum(1 for s in self.sessions.values() if s.active)

    def create(self, request: CreateSessionRequest) -> Session:
        api_key = secrets.token_urlsafe(32) if self.cfg.auth_token else None
        session = Session(secrets.token_urlsafe(24), request, api_key)
        self.sessions[session.id] = session
        self.metrics.sessions_created.inc()
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSessionError(f"unknown session {session_id[:8]}...")
        return session

    def session_credential_opens(self, path: str, headers: dict[bytes, bytes]) -> bool:
        """Whether the request's bearer credential is that of the active session whose route `path` is."""
        match = SESSION_ROUTES.fullmatch(path)
        session_id = match.group(1) if match else (headers.get(b"x-session-id", b"").decode("latin-1")
                                                   if path == HEADER_ROUTE else None)
        session = self.sessions.get(session_id) if session_id else None
        if session is None or session.api_key is None or not session.active:
            return False
        return hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {session.api_key}".encode())

    def open(self, session_id: str) -> Session:
        """A session that may still take turns."""
        session = self.get(session_id)
        session.ensure_open()
        return session

    # Finishing ---------------------------------------------------------------------------------------
    async def finish(self, session_id: str, request: FinishSessionRequest) -> FinishSessionResponse:
        """Idempotent: a session is finished once; later calls get the first reply."""
        if session_id in self.finish_replies:
            return self._finish_reply(session_id)
        session = self.get(session_id)
        if request.status == "aborted":
            return self.abort(session)
        async with session.lock:  # a turn in progress completes first
            if session_id in self.finish_replies:
                return self._finish_reply(session_id)
            if self.store is None:
                raise StoreUnavailableError("the gateway has no Redis configured (--redis-url): cannot record")
            try:
                refs = await record_session(self.store, session, request)
            except (redis.exceptions.RedisError, OSError) as err:
                log.warning("session %s...: writing samples failed: %r", session_id[:8], err)
                raise StoreUnavailableError(f"writing to Redis failed ({err}); the session stays open: retry") from err
            return self._close(session, request.status, refs)

    def abort(self, session: Session) -> FinishSessionResponse:
        """Close without recording; engine calls in flight are aborted (their turn fails with 409)."""
        if session.id in self.finish_replies:
            return self._finish_reply(session.id)
        reply = self._close(session, "aborted", [])
        self.spawn(self.runner.abort(dict(session.in_flight)))
        return reply

    def _close(self, session: Session, status: str, refs: list[str]) -> FinishSessionResponse:
        session.close(status, refs)
        reply = FinishSessionResponse(session_id=session.id, status=status, sample_refs=refs)
        self.finish_replies[session.id] = orjson.dumps(reply.model_dump())
        while len(self.finish_replies) > self.max_finish_replies:
            self.finish_replies.popitem(last=False)
        self.metrics.sessions_finished.labels(status).inc()
        self.metrics.samples_written.inc(len(refs))
        return reply

    def _finish_reply(self, session_id: str) -> FinishSessionResponse:
        return FinishSessionResponse.model_validate_json(self.finish_replies[session_id])

    # Housekeeping ------------------------------------------------------------------------------------
    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def sweep(self, now: Optional[float] = None) -> None:
        """Forget finished sessions past their TTL; abort open ones idle past the idle timeout."""
        now = now or time.time()
        for session in list(self.sessions.values()):
            idle = now - session.last_used
            if session.active and idle > self.cfg.session_idle_timeout_s and not session.lock.locked():
                log.warning("session %s... idle %.0fs: aborted", session.id[:8], idle)
                self.abort(session)
            elif not session.active and idle > self.cfg.finished_session_ttl_s:
                del self.sessions[session.id]

    async def sweep_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()

    async def shutdown(self) -> int:
        """Abort every open session (nothing half-finished reaches Redis); returns how many."""
        open_sessions = [s for s in self.sessions.values() if s.active]
        for session in open_sessions:
            self.abort(session)
        if self._background:
            await asyncio.wait(list(self._background), timeout=5.0)
        return len(open_sessions)
