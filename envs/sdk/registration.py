"""Self-registration with the orchestrator and the heartbeats that keep the service in its rotation.

    register (POST /v1/envs, retried with backoff until accepted)
      -> heartbeat every heartbeat_interval_s (POST /v1/envs/{id}/heartbeat {in_flight, healthy})
           404: the orchestrator forgot us (restart without state) -> register again
           other errors: logged, next beat as usual (missing beats are what marks us unhealthy)
    stop -> DELETE /v1/envs/{id}: the orchestrator drains us instead of waiting for missed beats
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

import httpx

from asyncrl.protocols.orchestrator import HeartbeatRequest, RegisterRequest, RegisterResponse

log = logging.getLogger("envs.registration")

PERMANENT_REJECTIONS = {400, 401, 403, 422}
"""Answers to a registration that retrying cannot fix (bad token, bad body): give up and say so."""


class RegistrationRejected(RuntimeError):
    pass


class Registrar:
    def __init__(self, orchestrator_url: str, registration: RegisterRequest, in_flight: Callable[[], int],
                 token: Optional[str] = None, retry_s: float = 0.5, max_retry_s: float = 30.0):
        self.registration = registration
        self.in_flight = in_flight
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.env_id: Optional[str] = None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=orchestrator_url.rstrip("/"), headers=headers, timeout=10.0)
        self._task: Optional[asyncio.Task] = None
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="env-registrar")

    async def stop(self) -> None:
        """Stop heartbeating and deregister (best effort: the orchestrator may already be gone)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.env_id is not None:
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

    async def _register(self) -> RegisterResponse:
        delay = self.retry_s
        while True:
            try:
                reply = await self._http.post("/v1/envs", json=self.registration.model_dump())
                if reply.status_code in PERMANENT_REJECTIONS:
                    raise RegistrationRejected(f"orchestrator rejected the registration: {reply.status_code} {reply.text}")
                reply.raise_for_status()
                accepted = RegisterResponse.model_validate(reply.json())
                self.env_id = accepted.env_id
                self.registered.set()
                log.info("registered name=%s url=%s as env_id=%s (heartbeat every %.1fs)", self.registration.name,
                         self.registration.url, accepted.env_id, accepted.heartbeat_interval_s)
                return accepted
            except (httpx.HTTPError, ValueError) as err:
                log.warning("registration with %s failed (%s); retrying in %.1fs", self._http.base_url, err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_retry_s)

    async def _heartbeat_until_forgotten(self, accepted: RegisterResponse) -> None:
        while True:
            beat = HeartbeatRequest(in_flight=self.in_flight(), healthy=True)
            try:
                reply = await self._http.post(f"/v1/envs/{accepted.env_id}/heartbeat", json=beat.model_dump())
                if reply.status_code == 404:
                    log.warning("orchestrator no longer knows env_id=%s; registering again", accepted.env_id)
                    self.env_id = None
                    self.registered.clear()
                    return
                reply.raise_for_status()
            except httpx.HTTPError as err:
                log.warning("heartbeat for env_id=%s failed: %s", accepted.env_id, err)
            await asyncio.sleep(accepted.heartbeat_interval_s)
