"""Wire types of the env-service protocol (shared/protocols/env-service.md), named after the endpoints.

No logic lives here: env services (envs/sdk/app.py) accept and return these types and the
orchestrator sends and reads them. Field validation turns a bad request into a 422 naming the field.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field


class EpisodeStatus(str, Enum):
    completed = "completed"
    """The episode ran to its end; the reward is the environment's verdict."""
    truncated = "truncated"
    """The agent ran out of turns or the deadline passed; the reward covers what was done."""
    failed = "failed"
    """The environment broke (sandbox or LLM endpoint error), not the agent: drop the sample."""
    aborted = "aborted"
    """Cancelled through POST /episodes/{id}/cancel (or service shutdown): never trained on."""


class SamplingParams(BaseModel):
    """Sampling of every model turn; unknown keys (top_k, stop, ...) are passed through to the endpoint."""

    model_config = ConfigDict(extra="allow")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(512, ge=1)


class LLMEndpoint(BaseModel):
    """The OpenAI-compatible endpoint of this episode (a gateway session)."""

    base_url: str = Field(min_length=1)
    """e.g. http://gateway/sessions/<sid>/v1"""
    model: str = "asyncrl"
    api_key: Optional[str] = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)


class EpisodeRequest(BaseModel):
    episode_id: str = Field(min_length=1, max_length=256)
    task_id: str = Field(min_length=1)
    seed: int = 0
    """Seeds the environment's own randomness (task variation, tie-breaks), not the model's sampling."""
    llm: LLMEndpoint
    max_turns: int = Field(20, ge=1)
    """Model calls the agent may make; the environment stops asking after this many (-> truncated)."""
    deadline_s: float = Field(600.0, gt=0)
    """Wall-clock budget of the whole episode; past it the episode ends as truncated."""


class EpisodeResponse(BaseModel):
    episode_id: str
    task_id: str
    reward: float
    status: EpisodeStatus
    num_turns: int
    """Model calls made (chat completion requests sent to the endpoint)."""
    info: dict[str, Any] = Field(default_factory=dict)


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
    version: str


class TasksResponse(BaseModel):
    task_ids: list[str]
    total: int


class ErrorResponse(BaseModel):
    error: str
    """What is wrong, naming the offending field or id."""
    fields: list[str] = Field(default_factory=list)
    """Dotted paths of the invalid request fields (validation errors only)."""
