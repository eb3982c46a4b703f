"""Wire types of the TITO gateway (shared/protocols/gateway.md, extensions in docs/gateway.md).

The sessions API is what the orchestrator calls: create a session per episode, hand its `base_url`
to the env service, finish it with the reward. `SessionRecord` is the live token ledger (GET).
`ChatCompletionRequest` is the subset of OpenAI's Chat Completions request the gateway honours;
replies are OpenAI `chat.completion` / `chat.completion.chunk` objects built in gateway/openai_api.py.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncrl.types import SAMPLE_STATUSES

FinishStatus = Literal["completed", "failed", "truncated", "aborted"]
SessionStatus = Literal["active", "completed", "failed", "truncated", "aborted"]
assert set(get_args(FinishStatus)) == set(SAMPLE_STATUSES)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Sessions API ------------------------------------------------------------------------------------
class SessionSampling(_Lenient):
    """Default sampling of the session's turns (SGLang names); a request's own values win."""

    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    max_new_tokens: Optional[int] = Field(None, ge=0)
    sampling_seed: Optional[int] = None
    """Turn k of the session samples with seed sampling_seed + k (reproducible episodes)."""
    allow_truncation: bool = False
    """The session's policy for truncated sampling (top_p < 1, top_k > 0, min_p > 0, min_new_tokens > 0):
    refused with a 400 naming the field unless true, since the recorded log-probs (and the trainer's) are
    those of the untruncated tempered distribution (asyncrl.config.SamplingConfig.allow_truncation)."""


class CreateSessionRequest(_Lenient):
    """POST /sessions."""

    group_id: str = ""
    task_id: str = ""
    env: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Copied into every Sample of the session (with the finish `info`)."""
    sampling: SessionSampling = Field(default_factory=SessionSampling)


class CreateSessionResponse(BaseModel):
    """201 reply of POST /sessions."""

    session_id: str
    """Unguessable (secrets.token_urlsafe): it is the capability to use the session."""
    base_url: str
    """`{gateway}/sessions/{session_id}/v1`: give it to any OpenAI client as its base_url."""


class FinishSessionRequest(_Lenient):
    """POST /sessions/{sid}/finish."""

    reward: float = 0.0
    status: FinishStatus = "completed"
    """`aborted` drops the session: nothing reaches Redis (a cancelled or re-dispatched episode)."""
    info: dict[str, Any] = Field(default_factory=dict)


class FinishSessionResponse(BaseModel):
    """Reply of POST /sessions/{sid}/finish; a repeated finish returns the first reply unchanged."""

    session_id: str
    status: FinishStatus
    sample_refs: list[str]
    """Stream ids in the run's `samples` stream, one per segment in order ([] when aborted or when
    the session never generated): the orchestrator puts them into the GroupRecord."""


class TurnRecord(BaseModel):
    """One engine call: its prompt was segment.tokens[:prompt_len], its output the next output_len tokens."""

    prompt_len: int
    output_len: int
    engine: str
    finish_reason: str
    """stop | length | abort (an interrupted call: the next call continues from its tokens)."""
    sampling: dict[str, Any] = Field(default_factory=dict)
    """The SGLang sampling params the call ran with (max_new_tokens left out)."""


class SegmentRecord(BaseModel):
    """One token sequence (a Sample at finish). A session has several when a client edited history."""

    tokens: list[int]
    loss_mask: list[int]
    """1 exactly on model-generated tokens."""
    rollout_logprobs: list[float]
    """Engine log-prob of each generated token; 0.0 where loss_mask is 0."""
    weight_versions: list[int]
    """Weight version that generated each token; -1 where loss_mask is 0."""
    temperatures: list[float]
    """Temperature each token's log-prob was taken at (1.0 where loss_mask is 0, and for greedy calls)."""
    turns: list[TurnRecord]
    messages: Optional[list[dict[str, Any]]] = None
    """Chat messages rendered so far (model turns as returned); None once token-native turns were mixed in."""
    tools: Optional[list[dict[str, Any]]] = None


class SessionRecord(BaseModel):
    """GET /sessions/{sid}: the live ledger."""

    session_id: str
    status: SessionStatus
    group_id: str
    task_id: str
    env: str
    segments: list[SegmentRecord]
    sample_refs: list[str] = Field(default_factory=list)
    """Filled once finished."""


# Engines (admin) --------------------------------------------------------------------------------
class UpdateEnginesRequest(_Lenient):
    """POST /engines: the full set of engine base URLs to route over (the launcher calls it)."""

    urls: list[str]


class EngineStatus(BaseModel):
    url: str
    healthy: bool
    in_flight: int
    requests: int
    failures: int


class EnginesResponse(BaseModel):
    """GET /engines and POST /engines."""

    engines: list[EngineStatus]


# Token-native turn ------------------------------------------------------------------------------
class SessionGenerateRequest(_Lenient):
    """POST /sessions/{sid}/generate: engine /generate shape; input_ids are appended to the history."""

    input_ids: list[int] = Field(min_length=0)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    """SGLang sampling params; the chat template's stop tokens are not added (token-native callers decide)."""
    return_logprob: bool = True
    stream: bool = False


# OpenAI Chat Completions (request) ---------------------------------------------------------------
class ChatCompletionRequest(_Lenient):
    """The fields of OpenAI's request the gateway honours; others (penalties, user, ...) are ignored."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    model: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    """Accepted; the model decides (GLM renders tools the same way for every choice)."""
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    """Extension (SGLang's): -1 disables."""
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    """Extension (SGLang's): 0 disables."""
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported (each choice would be its own trajectory: open more sessions)")
        return v

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(messages):
            if message.get("role") not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role {message.get('role')!r} is not one of {sorted(CHAT_ROLES)}")
        return messages

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
