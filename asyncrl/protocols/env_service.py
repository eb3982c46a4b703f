"""Wire types of the env-service protocol (docs/protocols/env-service.md), named after the endpoints.

No logic lives here: env services (envs/sdk/app.py) accept and return these types and the
orchestrator sends and reads them. Field validation turns a bad request into a 422 naming the field;
an EpisodeResponse also checks that its status agrees with its reason. The outcome taxonomy
(OutcomeClass, EpisodeReason, OUTCOMES) is the vocabulary of an episode's ending that the env
service, the orchestrator and the trainer share (docs/envs.md "Outcomes").
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from asyncrl.protocols.fields import HttpUrl, Id, Secret, Seed

SERVICE_TOKEN_ENV = "ASYNCRL_ENV_TOKEN"
"""The bearer token env services want on every route but /health and /metrics, where one is set; the
orchestrator and `asyncrl eval` send it (each reads it from this variable unless given on its command line)."""
MAX_TOKENS = 1_048_576
"""Most tokens one model reply may be asked for."""
MAX_TURNS = 100_000
MAX_DEADLINE_S = 7 * 86400.0


class EpisodeStatus(str, Enum):
    """What the trainer does with the episode; `EpisodeResponse.reason` says why it ended."""

    completed = "completed"
    """The episode ran to its end; the reward is the environment's verdict."""
    truncated = "truncated"
    """The model ran out of turns or tokens; the reward covers what was done. Trained like completed."""
    failed = "failed"
    """The environment or the infrastructure broke (env error, sandbox, LLM endpoint, deadline), not the
    model: the sample is dropped and counts as invalid for the group rule."""
    aborted = "aborted"
    """Cancelled through POST /episodes/{id}/cancel (or service shutdown): never trained on."""


class OutcomeClass(str, Enum):
    """Whose doing an episode's ending is; it decides whether the episode is trained."""

    model = "model"
    """The model finished, or ran out of turns or tokens: trained, whatever the reward."""
    environment = "environment"
    """The environment's own code broke (a tool, the grader, a result it cannot return): excluded."""
    infrastructure = "infrastructure"
    """What runs the episode failed (deadline, sandbox, LLM endpoint, env service): excluded. A slow
    host is not a bad answer, so it must not be trained as reward 0."""
    cancelled = "cancelled"
    """Cancelled by the caller or a shutdown: never recorded."""


class EpisodeReason(str, Enum):
    """Why an episode ended, as the env service reports it; OUTCOMES gives its class and status."""

    completed = "completed"
    max_turns = "max_turns"
    """The agent made max_turns model calls (the default reason of a truncated result)."""
    max_tokens = "max_tokens"
    """The model's last reply was cut at max_tokens (or the context filled up)."""
    env_error = "env_error"
    """run_episode raised (a tool, the grader, setup) or returned something the protocol cannot carry."""
    deadline_exceeded = "deadline_exceeded"
    """deadline_s passed before the episode ended."""
    sandbox_error = "sandbox_error"
    """The sandbox could not run a command or set up the episode (envs.sdk.SandboxError)."""
    llm_error = "llm_error"
    """The LLM endpoint (gateway, engine) failed: unreachable, timed out, or answered an error."""
    cancelled = "cancelled"


OUTCOMES: dict[EpisodeReason, tuple[OutcomeClass, EpisodeStatus]] = {
    EpisodeReason.completed: (OutcomeClass.model, EpisodeStatus.completed),
    EpisodeReason.max_turns: (OutcomeClass.model, EpisodeStatus.truncated),
    EpisodeReason.max_tokens: (OutcomeClass.model, EpisodeStatus.truncated),
    EpisodeReason.env_error: (OutcomeClass.environment, EpisodeStatus.failed),
    EpisodeReason.deadline_exceeded: (OutcomeClass.infrastructure, EpisodeStatus.failed),
    EpisodeReason.sandbox_error: (OutcomeClass.infrastructure, EpisodeStatus.failed),
    EpisodeReason.llm_error: (OutcomeClass.infrastructure, EpisodeStatus.failed),
    EpisodeReason.cancelled: (OutcomeClass.cancelled, EpisodeStatus.aborted),
}
"""The class and the status each reason implies (one table, so the three cannot disagree)."""

DEFAULT_REASONS = {EpisodeStatus.completed: EpisodeReason.completed, EpisodeStatus.truncated: EpisodeReason.max_turns,
                   EpisodeStatus.failed: EpisodeReason.env_error, EpisodeStatus.aborted: EpisodeReason.cancelled}
"""The reason a status stands for when none is given (an env's result, a service built before reasons)."""


class EndpointSampling(BaseModel):
    """Sampling of every model turn; unknown keys (top_k, stop, ...) are passed through to the endpoint."""

    model_config = ConfigDict(extra="allow")
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False, strict=True)
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)
    max_tokens: int = Field(512, ge=1, le=MAX_TOKENS, strict=True)


class LLMEndpoint(BaseModel):
    """The OpenAI-compatible endpoint of this episode (a gateway session)."""

    base_url: HttpUrl
    """e.g. http://gateway/sessions/<sid>/v1"""
    model: str = Field("asyncrl", max_length=256)
    api_key: Optional[Secret] = None
    """The bearer credential the agent's client sends to base_url: the gateway session's own credential
    when the gateway has an auth token (docs/protocols/gateway.md "Credentials"); None: a placeholder."""
    sampling: Optional[EndpointSampling] = None
    """What the agent sends with every model request; None (a gateway session): nothing, the endpoint's own
    defaults apply (the session's, which carry the run's sampling config)."""


class EpisodeRequest(BaseModel):
    episode_id: Id
    task_id: Id
    seed: Seed = 0
    """Seeds the environment's own randomness (task variation, tie-breaks), not the model's sampling."""
    llm: LLMEndpoint
    max_turns: int = Field(20, ge=1, le=MAX_TURNS, strict=True)
    """Model calls the agent may make; the environment stops asking after this many (-> truncated)."""
    deadline_s: float = Field(600.0, gt=0, le=MAX_DEADLINE_S, strict=True)
    """Wall-clock budget of the whole episode; past it the episode fails (reason deadline_exceeded)."""


class EpisodeResponse(BaseModel):
    episode_id: str
    task_id: str
    reward: float
    status: EpisodeStatus
    reason: EpisodeReason
    """Why it ended; must agree with `status` (OUTCOMES)."""
    num_turns: int
    """Model calls made (chat completion requests sent to the endpoint)."""
    info: dict[str, Any] = Field(default_factory=dict)

    @computed_field
    @property
    def outcome(self) -> OutcomeClass:
        """The reason's class, sent for readers that do not know the reason (ignored on input)."""
        return OUTCOMES[self.reason][0]

    @model_validator(mode="before")
    @classmethod
    def _reason_of_older_services(cls, body: Any) -> Any:
        """Services built before reasons existed send none: derive it from the status. Their deadline
        cut came as `truncated` with info.reason = deadline_exceeded; it is a failure now."""
        if not isinstance(body, dict) or "reason" in body or body.get("status") not in set(EpisodeStatus):
            return body
        if body["status"] == EpisodeStatus.truncated and (body.get("info") or {}).get("reason") == "deadline_exceeded":
            return {**body, "status": EpisodeStatus.failed, "reason": EpisodeReason.deadline_exceeded}
        return {**body, "reason": DEFAULT_REASONS[EpisodeStatus(body["status"])]}

    @model_validator(mode="after")
    def _status_agrees_with_reason(self) -> "EpisodeResponse":
        if OUTCOMES[self.reason][1] is not self.status:
            raise ValueError(f"reason {self.reason.value!r} means status {OUTCOMES[self.reason][1].value!r}, "
                             f"not {self.status.value!r}")
        return self


class CancelResponse(BaseModel):
    episode_id: str
    cancelled: bool
    """True when the episode was running and is now ending with status aborted."""


class HealthResponse(BaseModel):
    status: str = "ok"


class InfoResponse(BaseModel):
    name: str
    domain: str
    capacity: int
    """Episodes this service accepts concurrently; one more gets 429."""
    num_tasks: int
    """Tasks of the train split."""
    version: str
    splits: dict[str, int] = Field(default_factory=lambda: {})
    """Tasks per split the service serves (`train`, and `eval` where the env holds tasks out); empty from
    services built before splits, which serve train only."""


TASK_SPLITS = ("train", "eval")
"""The split names asyncrl itself uses: `train` (what RL trains on, the default everywhere) and `eval`
(held-out tasks, scored by `asyncrl eval`). An env may serve more (GET /tasks?split=NAME)."""


class TasksResponse(BaseModel):
    """GET /tasks?split=train|eval&offset=&limit=: a page of one split's task ids (default train)."""

    task_ids: list[str]
    total: int
    split: str = "train"


class ErrorResponse(BaseModel):
    error: str
    """What is wrong, naming the offending field or id."""
    fields: list[str] = Field(default_factory=list)
    """Dotted paths of the invalid request fields (validation errors only)."""
