"""Calls the orchestrator makes to env services (docs/protocols/env-service.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Optional

import aiohttp
from pydantic import ValidationError

from asyncrl.auth import bearer_headers
from asyncrl.protocols.env_service import EpisodeRequest, EpisodeResponse, InfoResponse, TasksResponse
from orchestrator.http import HTTPFailure, SendClock, request_json
from orchestrator.outcomes import SERVICE_ERROR

log = logging.getLogger("orchestrator.envclient")

REFUSALS = {429, 503}
"""At capacity / shutting down: the episode goes elsewhere or later, no attempt is charged."""

TASK_PAGE = 10_000


@dataclass
class Outcome:
    kind: Literal["result", "refused", "error"]
    response: Optional[EpisodeResponse] = None
    error: str = ""
    unreachable: bool = False
    """No connection to the service could be made: it is down."""
    reason: str = SERVICE_ERROR
    """Of an error (no response): why the attempt failed (orchestrator/outcomes.py)."""


class EnvClient:
    def __init__(self, http: aiohttp.ClientSession, token: Optional[str] = None) -> None:
        self.http = http
        self.headers = bearer_headers(token)

    async def run_episode(self, url: str, request: EpisodeRequest, timeout_s: float, clock: SendClock) -> Outcome:
        """POST /episodes and wait for the episode to end (the request is held open meanwhile)."""
        try:
            status, body = await request_json(self.http, "POST", f"{url}/episodes", request.model_dump(mode="json"),
                                              timeout_s, self.headers, trace=clock)
        except HTTPFailure as err:
            return Outcome("error", error=str(err), unreachable=err.unreachable)
        if status in REFUSALS:
            return Outcome("refused", error=f"{status} {body}")
        if status != 200:
            return Outcome("error", error=f"{status} {body}")
        try:
            return Outcome("result", EpisodeResponse.model_validate(body))
        except ValidationError as err:
            return Outcome("error", error=f"malformed episode response: {err}")

    async def cancel(self, url: str, episode_id: str) -> None:
        """Best effort: the service also cancels an episode whose caller hung up."""
        try:
            await request_json(self.http, "POST", f"{url}/episodes/{episode_id}/cancel", timeout_s=5.0,
                               headers=self.headers)
        except HTTPFailure as err:
            log.debug("cancel %s at %s: %s", episode_id, url, err)

    async def healthy(self, url: str, timeout_s: float) -> bool:
        try:
            status, _ = await request_json(self.http, "GET", f"{url}/health", timeout_s=timeout_s)
        except HTTPFailure:
            return False
        return status == 200

    async def info(self, url: str) -> InfoResponse:
        return InfoResponse.model_validate(await self._get(f"{url}/info"))

    async def tasks(self, url: str, split: str = "train") -> list[str]:
        """Every task id of `split`, paging through GET /tasks (orchestrator.task_split: train in training,
        the held-out split under `asyncrl eval`); services built before splits ignore the parameter."""
        task_ids: list[str] = []
        while True:
            page = TasksResponse.model_validate(
                await self._get(f"{url}/tasks?split={split}&offset={len(task_ids)}&limit={TASK_PAGE}"))
            if page.split != split:
                raise ValueError(f"the env service at {url} serves no splits: it answered split {split!r} with its "
                                 f"{page.split!r} tasks (update it, or play its {page.split!r} split)")
            task_ids += page.task_ids
            if not page.task_ids or len(task_ids) >= page.total:
                return task_ids

    async def _get(self, url: str) -> dict:
        status, body = await request_json(self.http, "GET", url, timeout_s=30.0, headers=self.headers)
        if status != 200:
            raise HTTPFailure(f"GET {url}: {status} {body}")
        return body
