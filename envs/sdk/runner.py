"""The life of an episode inside a service: admission, the env call, deadline, cancel, outcome.

admit ──> play (LLM client + fresh sandbox + env.run_episode, under the deadline) ──> response
            ├─ returns EpisodeResult       -> completed / truncated (reason completed, max_turns, max_tokens)
            ├─ deadline passes             -> failed, reason deadline_exceeded
            ├─ raises SandboxError         -> failed, reason sandbox_error
            ├─ raises openai.APIError      -> failed, reason llm_error (the LLM endpoint failed)
            ├─ raises anything else, or returns what the protocol cannot carry
            │                              -> failed, reason env_error
            └─ POST .../cancel or drain    -> aborted, reason cancelled

This is where an episode's outcome class is decided (asyncrl/protocols/env_service.py OUTCOMES):
only what the environment returns is a model outcome; every failure has info.error saying what broke.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from contextlib import asynccontextmanager, nullcontext
from typing import AsyncIterator, Optional

import httpx
from openai import APIError, AsyncOpenAI

from asyncrl.protocols.env_service import (DEFAULT_REASONS, OUTCOMES, EpisodeReason, EpisodeRequest, EpisodeResponse,
                                           EpisodeStatus, OutcomeClass)
from envs.sdk.base import Environment, EpisodeContext, EpisodeResult, ToolLog
from envs.sdk.context import ContextConfig, ContextLog, build_policy
from envs.sdk.metrics import ServiceMetrics
from envs.sdk.sandbox import SandboxBackend, SandboxError

log = logging.getLogger("envs.runner")

LOGGED_FAILURES = frozenset(r for r, (outcome, _) in OUTCOMES.items()
                            if outcome in (OutcomeClass.environment, OutcomeClass.infrastructure))
"""Endings the service's log gets a warning line for (a refused result, a deadline cut, a broken sandbox or
LLM endpoint): an operator reads why episodes were excluded without turning on debug logging."""


class AdmissionError(Exception):
    status_code = 400


class AtCapacity(AdmissionError):
    status_code = 429


class UnknownTask(AdmissionError):
    status_code = 404


class DuplicateEpisode(AdmissionError):
    status_code = 409


class Draining(AdmissionError):
    status_code = 503


class _TurnCounter:
    """Counts the chat completions the endpoint answered: the episode's model calls. A failed attempt the
    OpenAI client retries (a 503, a timeout) is not a turn: the gateway did not commit it either."""

    def __init__(self) -> None:
        self.turns = 0

    async def on_response(self, response: httpx.Response) -> None:
        if response.is_success and response.request.url.path.endswith("/chat/completions"):
            self.turns += 1


class EpisodeRunner:
    def __init__(self, env: Environment, capacity: int, sandboxes: Optional[SandboxBackend],
                 metrics: ServiceMetrics, llm_max_retries: int = 1, context: Optional[ContextConfig] = None):
        self.env = env
        self.context = context or ContextConfig()
        """The env's context management, a fresh policy of it per episode (EpisodeContext.context_policy)."""
        self.capacity = capacity
        self.sandboxes = sandboxes
        self.metrics = metrics
        self.llm_max_retries = llm_max_retries
        self.splits: dict[str, list[str]] = {"train": []}
        """Task ids of every split the env serves (Environment.splits); `train` always."""
        self._known_tasks: set[str] = set()
        self._running: dict[str, asyncio.Task] = {}
        self._draining = False
        self._ssl = httpx.create_ssl_context()
        """Shared by every episode's client: building one loads the CA bundle (~50-250 ms of CPU)."""

    @property
    def task_ids(self) -> list[str]:
        """The train split: what the orchestrator trains on."""
        return self.splits["train"]

    async def load_tasks(self) -> None:
        """Every split's task ids. train is asked for without an argument (envs written before splits
        take none); the ids of all splits must be distinct, within and across splits."""
        env, name = self.env, type(self.env).__name__
        splits = list(dict.fromkeys(["train", *getattr(env, "splits", ("train",))]))
        self.splits = {split: list(await (env.list_tasks() if split == "train" else env.list_tasks(split=split)))
                       for split in splits}
        self._known_tasks = set()
        for split, ids in self.splits.items():
            if len(set(ids)) != len(ids):
                raise ValueError(f"{name}.list_tasks(split={split!r}) returned duplicate task ids")
            shared = self._known_tasks.intersection(ids)
            if shared:
                raise ValueError(f"{name}: split {split!r} shares task ids with another split (e.g. "
                                 f"{sorted(shared)[0]!r}); held-out tasks must be disjoint from the train tasks")
            self._known_tasks.update(ids)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def admit(self, req: EpisodeRequest) -> None:
        if self._draining:
            raise Draining("the service is shutting down; send the episode elsewhere")
        if req.episode_id in self._running:
            raise DuplicateEpisode(f"episode_id {req.episode_id!r} is already running")
        if req.task_id not in self._known_tasks:
            raise UnknownTask(f"unknown task_id {req.task_id!r} (GET /tasks lists them)")
        if len(self._running) >= self.capacity:
            self.metrics.rejected.inc()
            raise AtCapacity(f"at capacity: {self.capacity} episodes in flight")

    async def run(self, req: EpisodeRequest) -> EpisodeResponse:
        """Admit, play and report one episode; the caller's request stays open until it ends."""
        self.admit(req)
        started, counter, context, tools = time.monotonic(), _TurnCounter(), ContextLog(), ToolLog()
        play = asyncio.create_task(self._play(req, counter, context, tools), name=f"episode-{req.episode_id}")
        self._running[req.episode_id] = play
        self.metrics.in_flight.set(len(self._running))
        try:
            result = await self._outcome(play)
        finally:
            del self._running[req.episode_id]
            self.metrics.in_flight.set(len(self._running))
        elapsed = time.monotonic() - started
        turns = counter.turns if result.num_turns is None else result.num_turns
        self.metrics.finished(result.reason, result.reward, turns, elapsed)
        self.metrics.context(context)
        self.metrics.tools(tools)
        info = {**result.info, "context": context.summary()} if context.prompt_tokens or context.edits else result.info
        info = {**info, "tools": tools.summary()} if tools.calls else info
        log.log(logging.WARNING if result.reason in LOGGED_FAILURES else logging.DEBUG,
                "episode=%s task=%s status=%s reason=%s reward=%.3f turns=%d seconds=%.2f%s", req.episode_id,
                req.task_id, result.status.value, result.reason.value, result.reward, turns, elapsed,
                f" error={result.info['error']!r}" if "error" in result.info else "")
        return EpisodeResponse(episode_id=req.episode_id, task_id=req.task_id, reward=result.reward,
                               status=result.status, reason=result.reason, num_turns=turns,
                               info=_jsonable(info))

    def cancel(self, episode_id: str) -> bool:
        play = self._running.get(episode_id)
        return play is not None and play.cancel()

    def refuse_new(self) -> None:
        """From now on admit() answers 503: the service is going away."""
        self._draining = True

    async def drain(self, grace_s: float) -> None:
        """Refuse new episodes, let running ones finish for up to grace_s, then abort the rest."""
        self.refuse_new()
        deadline = time.monotonic() + grace_s
        while self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for episode_id in list(self._running):
            self.cancel(episode_id)
        while self._running:
            await asyncio.sleep(0.02)

    async def _outcome(self, play: asyncio.Task) -> EpisodeResult:
        try:
            return await play
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the request itself is being torn down, not just this episode
            return _ended(EpisodeReason.cancelled, {})

    async def _play(self, req: EpisodeRequest, counter: _TurnCounter, context: ContextLog,
                    tools: ToolLog) -> EpisodeResult:
        ctx = EpisodeContext(episode_id=req.episode_id, task_id=req.task_id, seed=req.seed, max_turns=req.max_turns,
                             deadline_s=req.deadline_s, model=req.llm.model,
                             sampling=req.llm.sampling.model_dump() if req.llm.sampling else {},
                             context_policy=build_policy(self.context), context_log=context, tool_log=tools)
        budget = asyncio.timeout(req.deadline_s)
        try:
            async with budget, self._llm(req, counter) as llm, self._sandbox(req.episode_id) as sandbox:
                result = await self.env.run_episode(req.task_id, llm, sandbox, ctx)
        except Exception as err:  # noqa: BLE001 - anything escaping the env is a failure, never the model's
            if budget.expired():
                return _ended(EpisodeReason.deadline_exceeded, {"error": f"deadline_s={req.deadline_s:g} passed",
                                                                "deadline_s": req.deadline_s})
            log.exception("episode=%s task=%s failed", req.episode_id, req.task_id)
            return _ended(_failure_reason(err), {"error": f"{type(err).__name__}: {err}"})
        return _checked(result, type(self.env).__name__, self.env.reward_range)

    @asynccontextmanager
    async def _llm(self, req: EpisodeRequest, counter: _TurnCounter) -> AsyncIterator[AsyncOpenAI]:
        http = httpx.AsyncClient(event_hooks={"response": [counter.on_response]}, verify=self._ssl,
                                 timeout=httpx.Timeout(req.deadline_s, connect=10.0))
        client = AsyncOpenAI(base_url=req.llm.base_url, api_key=req.llm.api_key or "none",
                             max_retries=self.llm_max_retries, http_client=http)
        try:
            yield client
        finally:
            await client.close()

    def _sandbox(self, episode_id: str):
        if not self.env.requires_sandbox:
            return nullcontext(None)
        return self.sandboxes.session(episode_id)


def _ended(reason: EpisodeReason, info: dict) -> EpisodeResult:
    """An episode that ended without a result of the environment: reward 0, the reason's status."""
    return EpisodeResult(0.0, OUTCOMES[reason][1], info, reason)


def _failure_reason(err: Exception) -> EpisodeReason:
    """The reason an exception out of the episode names: the sandbox, the LLM endpoint, or the env itself."""
    if isinstance(err, SandboxError):
        return EpisodeReason.sandbox_error
    if isinstance(err, APIError):
        return EpisodeReason.llm_error
    return EpisodeReason.env_error


def _checked(result: EpisodeResult, env_name: str, reward_range: tuple[float, float]) -> EpisodeResult:
    """The env's result as a model outcome with its reason, or an env_error saying what the env got wrong."""
    low, high = reward_range
    if not isinstance(result, EpisodeResult):
        problem = f"{env_name}.run_episode returned {type(result).__name__}, not EpisodeResult"
    elif not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
        problem = f"non-finite reward {result.reward!r}"
    elif not low <= result.reward <= high:
        problem = f"reward {result.reward!r} outside {env_name}.reward_range [{low:g}, {high:g}]"
    elif result.status not in (EpisodeStatus.completed, EpisodeStatus.truncated):
        problem = f"env returned status {getattr(result.status, 'value', result.status)!r}; raise to report a failure"
    else:
        status = EpisodeStatus(result.status)
        reason = result.reason or DEFAULT_REASONS[status]
        if OUTCOMES.get(reason) == (OutcomeClass.model, status):
            return EpisodeResult(result.reward, status, result.info, EpisodeReason(reason), result.num_turns)
        problem = f"env returned status {status.value!r} with reason {getattr(reason, 'value', reason)!r}"
    return _ended(EpisodeReason.env_error, {"error": problem})


def _jsonable(info: dict) -> dict:
    return json.loads(json.dumps(info, default=str))
