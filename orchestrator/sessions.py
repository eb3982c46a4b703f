"""Where an episode's LLM endpoint comes from: the boundary between the orchestrator and the gateway.

`SessionProvider` opens one session per episode attempt and finishes it with the result. Two kinds,
chosen by `OrchestratorConfig.sessions`:

- `gateway`: a TITO gateway session (docs/protocols/gateway.md). finish(completed|truncated|failed)
  makes the gateway append the trajectory to Redis and returns its sample refs; finish(aborted)
  records nothing. The session carries the run's sampling as its defaults, and the episode's endpoint
  no sampling of its own: the agent sends none, so the run's setting has one path to the engine. With a
  gateway token, the episode's endpoint carries the session's own credential
  (the reply's `api_key`), never the gateway token itself. Finishing is idempotent: a repeated finish returns the first reply, which is how a
  restarted orchestrator learns whether a session of the previous one was already recorded.
- `endpoint`: every episode uses one fixed OpenAI-compatible URL, the run's sampling in its endpoint for
  the agent to send; nothing is recorded (benchmarks of the orchestrator and env services without a model).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from asyncrl.auth import bearer_headers
from asyncrl.config import OrchestratorConfig
from asyncrl.plugins import load_plugin
from asyncrl.protocols.env_service import LLMEndpoint
from asyncrl.protocols.gateway import CreateSessionRequest, FinishSessionRequest
from orchestrator.groups import Group, Member
from orchestrator.http import HTTPFailure, request_json
from orchestrator.sampling import endpoint_sampling, session_sampling

log = logging.getLogger("orchestrator.sessions")

BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
GATEWAY_DOWN_S = 2.0
"""With several gateways, one that did not take a new session is asked last for this long."""


@dataclass
class Finished:
    status: str
    """The status the session was closed with (the first finish's, when it had been finished before)."""
    sample_refs: list[str] = field(default_factory=list)


class SessionProvider(ABC):
    def __init__(self, cfg: OrchestratorConfig) -> None:
        self.model = cfg.model_name

    @abstractmethod
    async def open(self, group: Group, member: Member, episode_id: str) -> tuple[Optional[str], LLMEndpoint]:
        """(session_id or None, the endpoint to put into the EpisodeRequest)."""

    @abstractmethod
    async def finish(self, session_id: Optional[str], status: str, reward: float = 0.0,
                     info: Optional[dict[str, Any]] = None) -> Finished:
        """Close the session; status `aborted` records nothing."""

    async def close(self) -> None:
        pass


class EndpointSessions(SessionProvider):
    def __init__(self, cfg: OrchestratorConfig, http: aiohttp.ClientSession) -> None:
        super().__init__(cfg)
        if not cfg.llm_url:
            raise ValueError("sessions=endpoint needs llm_url (an OpenAI-compatible base URL)")
        self.endpoint = LLMEndpoint(base_url=cfg.llm_url, model=self.model, sampling=endpoint_sampling(cfg.sampling))

    async def open(self, group, member, episode_id):
        return None, self.endpoint

    async def finish(self, session_id, status, reward=0.0, info=None) -> Finished:
        return Finished(status)


class GatewaySessions(SessionProvider):
    """Sessions on one gateway or several (`gateway_url`: their URLs, comma-separated). A new session goes to
    the gateway with the fewest sessions this orchestrator opened there (or is opening: a group's members
    ask at once) and has not finished; one that does not answer is passed over for the next. A session is finished where it was opened; a session of a
    previous orchestrator process (recovery) at the gateway that knows it (each is asked: a gateway answers
    404 for a session it does not hold)."""

    def __init__(self, cfg: OrchestratorConfig, http: aiohttp.ClientSession) -> None:
        super().__init__(cfg)
        self.urls = gateway_urls(cfg.gateway_url)
        if not self.urls:
            raise ValueError("sessions=gateway needs gateway_url")
        self.http = http
        self.headers = bearer_headers(cfg.gateway_token)
        self.config_sampling = cfg.sampling
        self.open_sessions = dict.fromkeys(self.urls, 0)
        """Sessions opened or being opened at each gateway and not finished yet (placement). A gateway is
        counted when it is chosen, before its reply: counted after, the concurrent opens of a group all see
        the same counts and all go to the first gateway."""
        self.down_until = dict.fromkeys(self.urls, 0.0)
        """A gateway that did not take a session is asked last until then (monotonic time)."""
        self._gateway_of: dict[str, str] = {}

    async def open(self, group, member, episode_id):
        body = CreateSessionRequest(
            group_id=group.group_id, task_id=group.task_id, env=group.env,
            metadata={"episode_id": episode_id, "member": member.index, "attempt": member.attempt, "seed": member.seed},
            sampling=session_sampling(self.config_sampling, member.seed)).model_dump()
        url, reply = await self._create(body)
        self._gateway_of[reply["session_id"]] = url
        return reply["session_id"], LLMEndpoint(base_url=reply["base_url"], model=self.model,
                                                api_key=reply.get("api_key"))  # sampling: the session's defaults

    async def _create(self, body: dict) -> tuple[str, dict]:
        """(gateway, reply): the least loaded gateway that answers; while none does, wait and ask again."""
        attempt = 0
        while True:
            now = time.monotonic()
            for url in sorted(self.urls, key=lambda u: (self.down_until[u] > now, self.open_sessions[u])):
                self.open_sessions[url] += 1
                reply = None
                try:
                    reply = await self._call("POST", url, "/sessions", body, expect=(201,),
                                             retry=len(self.urls) == 1)
                    return url, reply
                except GatewayUnavailable as err:
                    if self.down_until[url] <= now:
                        log.warning("gateway %s: POST /sessions failed (%s); new sessions go to the others first "
                                    "for %g s", url, err, GATEWAY_DOWN_S)
                    self.down_until[url] = time.monotonic() + GATEWAY_DOWN_S
                finally:
                    if reply is None:  # not placed there (unavailable, refused, or the episode was cancelled)
                        self.open_sessions[url] -= 1
            delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
            log.warning("no gateway took a new session; retrying in %.1fs", delay)
            await asyncio.sleep(delay)
            attempt += 1

    async def finish(self, session_id, status, reward=0.0, info=None) -> Finished:
        body = FinishSessionRequest(reward=reward, status=status, info=info or {}).model_dump()
        url = self._gateway_of.pop(session_id, None)
        if url is not None:
            self.open_sessions[url] -= 1
        for gateway in [url] if url is not None else self.urls:
            try:
                reply = await self._call("POST", gateway, f"/sessions/{session_id}/finish", body, expect=(200,))
                return Finished(reply["status"], list(reply["sample_refs"]))
            except UnknownSession:
                continue
        log.warning("gateway does not know session %s... (expired or gateway restarted): nothing recorded",
                    session_id[:8])
        return Finished("aborted")

    async def _call(self, method: str, url: str, path: str, body: dict, expect: tuple[int, ...],
                    retry: bool = True) -> dict:
        """Retry transport errors and 5xx (gateway restarting, Redis hiccup) with backoff; while the
        gateway is down, episodes wait here rather than fail. retry=False: raise GatewayUnavailable."""
        attempt = 0
        while True:
            try:
                status, reply = await request_json(self.http, method, url + path, body, 60.0, self.headers)
                if status in expect:
                    return reply
                if status == 404:
                    raise UnknownSession(path)
                problem = f"{status} {reply}"
                if status < 500 and status != 429:
                    raise GatewayError(f"gateway refused {method} {path}: {problem}")
            except HTTPFailure as err:
                problem = str(err)
            if not retry:
                raise GatewayUnavailable(problem)
            delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
            log.warning("gateway %s %s failed (%s); retrying in %.1fs", method, url + path, problem, delay)
            await asyncio.sleep(delay)
            attempt += 1


def gateway_urls(value: Optional[str]) -> list[str]:
    """`gateway_url`'s URLs (comma-separated for several gateways), without trailing slashes."""
    return [u.strip().rstrip("/") for u in (value or "").split(",") if u.strip()]


class GatewayUnavailable(ConnectionError):
    """A gateway did not answer or answered 5xx / 429 (it may be restarting)."""


class UnknownSession(LookupError):
    pass


class GatewayError(RuntimeError):
    """A 4xx from the gateway: a bug or a misconfiguration (wrong token), not a transient failure."""


SESSION_PROVIDERS: dict[str, str] = {"gateway": "orchestrator.sessions:GatewaySessions",
                                     "endpoint": "orchestrator.sessions:EndpointSessions"}
"""`orchestrator.sessions` built-ins -> import path of their SessionProvider (asyncrl/plugins.py)."""


def make_sessions(cfg: OrchestratorConfig, http: aiohttp.ClientSession) -> SessionProvider:
    """The provider `cfg.sessions` names (a built-in or the import path of a SessionProvider)."""
    return load_plugin(SESSION_PROVIDERS, cfg.sessions, "orchestrator.sessions")(cfg, http)
