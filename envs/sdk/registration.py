"""Self-registration with the orchestrator and the heartbeats that keep the service in its rotation.

    register (POST /v1/envs, retried with backoff until accepted)
      -> heartbeat every heartbeat_interval_s (POST /v1/envs/{id}/heartbeat {in_flight, healthy})
           404: the orchestrator forgot us (restart without state) -> register again
           other errors: logged, next beat as usual (missing beats are what marks us unhealthy)
    no accepted registration or heartbeat for gone_after_s (the orchestrator is dead, or moved)
      -> `gone` is set and the registrar stops: the service exits (envs.serve: status 3)
    stop -> DELETE /v1/envs/{id}: the orchestrator drains us instead of waiting for missed beats

Heartbeats are logged at DEBUG; registration, loss of contact (then every 30 s) and its return at INFO /
WARNING.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

import httpx

from asyncrl.auth import bearer_headers
from asyncrl.protocols.orchestrator import HeartbeatRequest, RegisterRequest, RegisterResponse

log = logging.getLogger("envs.registration")

PERMANENT_REJECTIONS = {400, 401, 403, 422}
"""Answers to a registration that retrying cannot fix (bad token, bad body): give up and say so."""

DEFAULT_GONE_AFTER_S = 300.0
WARN_EVERY_S = 30.0
"""While the orchestrator is unreachable, failed calls are logged at WARNING this often (DEBUG between)."""


class RegistrationRejected(RuntimeError):
    pass


class OrchestratorGone(RuntimeError):
    pass


class Registrar:
    def __init__(self, orchestrator_url: str, registration: RegisterRequest, in_flight: Callable[[], int],
                 token: Optional[str] = None, retry_s: float = 0.5, max_retry_s: float = 30.0,
                 gone_after_s: Optional[float] = DEFAULT_GONE_AFTER_S):
        self.registration = registration
        self.in_flight = in_flight
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.gone_after_s = gone_after_s
        """No accepted registration or heartbeat for this long: the orchestrator is gone (None: never)."""
        self.env_id: Optional[str] = None
        headers = bearer_headers(token)
        # A hung orchestrator must not hold one call past the bound either.
        timeout_s = 10.0 if gone_after_s is None else min(10.0, max(0.5, gone_after_s / 3))
        self._http = httpx.AsyncClient(base_url=orchestrator_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self._task: Optional[asyncio.Task] = None
        self.registered = asyncio.Event()
        self.gone = asyncio.Event()
        """Set when the orchestrator stayed unreachable for gone_after_s; `gone_reason` says what failed."""
        self.gone_reason = ""
        self._last_contact = time.monotonic()
        """The start counts as contact: an orchestrator that never answers is gone after gone_after_s too."""
        self._failing_since: Optional[float] = None
        self._warned_at = 0.0

    def start(self) -> None:
        self._last_contact = time.monotonic()
        self._task = asyncio.create_task(self._run(), name="env-registrar")

    async def stop(self) -> None:
        """Stop heartbeating and deregister (best effort: the orchestrator may already be gone)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.env_id is not None and not self.gone.is_set():
            try:
                await self._http.delete(f"/v1/envs/{self.env_id}", timeout=3.0)
                log.info("deregistered env_id=%s", self.env_id)
            except httpx.HTTPError as err:
                log.warning("deregistering env_id=%s failed: %s", self.env_id, err)
        await self._http.aclose()

    async def _run(self) -> None:
        try:
            while True:
                accepted = await self._register()
                await self._heartbeat_until_forgotten(accepted)
        except RegistrationRejected as err:
            log.error("%s; the service keeps serving but the orchestrator will not send it episodes", err)
        except OrchestratorGone as err:
            self.gone_reason = str(err)
            self.registered.clear()
            self.gone.set()

    def _contact(self) -> None:
        """The orchestrator answered as it should (accepted a registration or a beat, or said 404)."""
        if self._failing_since is not None:
            log.info("orchestrator %s reachable again after %.1fs", self._http.base_url,
                     time.monotonic() - self._failing_since)
            self._failing_since = None
        self._last_contact = time.monotonic()

    def _warn(self, message: str, *args: object) -> None:
        """Failed calls while the orchestrator is unreachable: a WARNING at the first and every 30 s, DEBUG between."""
        now = time.monotonic()
        first = self._failing_since is not None and self._warned_at < self._failing_since
        level = logging.WARNING if first or now - self._warned_at >= WARN_EVERY_S else logging.DEBUG
        if level == logging.WARNING:
            self._warned_at = now
        log.log(level, message, *args)

    def _failed(self, what: str, err: object) -> float:
        """A failed call: raises OrchestratorGone past gone_after_s without contact, else returns the
        seconds left (so the next wait does not overshoot the bound)."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        silent = now - self._last_contact
        if self.gone_after_s is not None and silent >= self.gone_after_s:
            raise OrchestratorGone(f"no answer from the orchestrator {self._http.base_url} for {silent:.1f}s "
                                   f"(--orchestrator-gone-s {self.gone_after_s:g}); last error: {what}: {err}")
        return float("inf") if self.gone_after_s is None else self.gone_after_s - silent

    async def _register(self) -> RegisterResponse:
        delay = self.retry_s
        while True:
            try:
                reply = await self._http.post("/v1/envs", json=self.registration.model_dump())
                if reply.status_code in PERMANENT_REJECTIONS:
                    raise RegistrationRejected(f"orchestrator rejected the registration: {reply.status_code} {reply.text}")
                reply.raise_for_status()
                accepted = RegisterResponse.model_validate(reply.json())
            except (httpx.HTTPError, ValueError) as err:
                left = self._failed("registration", err)
                self._warn("registration with %s failed (%s); retrying in %.1fs", self._http.base_url, err,
                           min(delay, left))
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, self.max_retry_s)
                continue
            self._contact()
            self.env_id = accepted.env_id
            self.registered.set()
            log.info("registered name=%s domain=%s url=%s as env_id=%s (heartbeat every %.1fs)",
                     self.registration.name, self.registration.domain, self.registration.url, accepted.env_id,
                     accepted.heartbeat_interval_s)
            return accepted

    async def _heartbeat_until_forgotten(self, accepted: RegisterResponse) -> None:
        while True:
            beat = HeartbeatRequest(in_flight=self.in_flight(), healthy=True)
            wait = accepted.heartbeat_interval_s
            try:
                reply = await self._http.post(f"/v1/envs/{accepted.env_id}/heartbeat", json=beat.model_dump())
                if reply.status_code == 404:
                    self._contact()
                    log.warning("orchestrator no longer knows env_id=%s; registering again", accepted.env_id)
                    self.env_id = None
                    self.registered.clear()
                    return
                reply.raise_for_status()
                self._contact()
                log.debug("heartbeat env_id=%s in_flight=%d", accepted.env_id, beat.in_flight)
            except httpx.HTTPError as err:
                left = self._failed("heartbeat", err)
                self._warn("heartbeat for env_id=%s failed: %s%s", accepted.env_id, err,
                           f" (giving up on the orchestrator in {left:.0f}s)" if left != float("inf") else "")
                wait = min(wait, left)
            await asyncio.sleep(wait)
