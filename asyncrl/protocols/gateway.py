"""Wire types of the TITO gateway (docs/protocols/gateway.md, extensions in docs/gateway.md).

The sessions API is what the orchestrator calls: create a session per episode, hand its `base_url`
to the env service, finish it with the reward. `SessionRecord` is the live token ledger (GET).
`ChatCompletionRequest` is OpenAI's Chat Completions request: every field is honoured or refused with a
400 naming it, never ignored; replies are OpenAI `chat.completion` / `chat.completion.chunk` objects built
in gateway/openai_api.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

from asyncrl.protocols.engine import MAX_SEED
from asyncrl.protocols.fields import LongIds
from asyncrl.types import SAMPLE_STATUSES

FinishStatus = Literal["completed", "failed", "truncated", "aborted"]
SessionStatus = Literal["active", "completed", "failed", "truncated", "aborted"]
assert set(get_args(FinishStatus)) == set(SAMPLE_STATUSES)


class _IgnoresUnknown(BaseModel):
    """Unknown fields are ignored (clients may be newer than this gateway); every known one is validated."""

    model_config = ConfigDict(extra="ignore")


# Sessions API ------------------------------------------------------------------------------------
class SessionSampling(_IgnoresUnknown):
    """Default sampling of the session's turns (SGLang names); a request's own values win. Types are strict
    (no "0.7" for 0.7, no true for 1), as in every sampling field the gateway takes."""

    model_config = ConfigDict(extra="ignore", strict=True)

    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    max_new_tokens: Optional[int] = Field(None, ge=0)
    sampling_seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    """Turn k of the session samples with seed sampling_seed + k, modulo 2**64 (reproducible episodes)."""
    allow_truncation: bool = False
    """The session's policy for truncated sampling (top_p < 1, top_k > 0, min_p > 0, min_new_tokens > 0):
    refused with a 400 naming the field unless true, since the recorded log-probs (and the trainer's) are
    those of the untruncated tempered distribution (asyncrl.config.SamplingConfig.allow_truncation)."""


class CreateSessionRequest(_IgnoresUnknown):
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
    api_key: Optional[str] = None
    """When the gateway has an auth token: this session's own bearer credential, for the OpenAI client's
    api_key. It opens this session's model routes (`.../v1/...`, `/generate`) while the session is active,
    nothing else (not finish, not other sessions). None when the gateway has no token."""


class FinishSessionRequest(_IgnoresUnknown):
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
class UpdateEnginesRequest(_IgnoresUnknown):
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


# Fields the gateway cannot honour -----------------------------------------------------------------
def _empty(value: Any) -> bool:
    return not value


def _absent(value: Any) -> bool:
    return value is None


def _refuse_unhonoured(model: type[BaseModel], data: Any, unhonoured: dict[str, tuple[Callable[[Any], bool], str]],
                       what: str) -> Any:
    """Before validation: a 400 naming every field of `data` the gateway would otherwise ignore: one of
    `unhonoured` at a non-neutral value (with why), or one `model` does not declare (null is absence)."""
    if not isinstance(data, dict):
        return data
    refused = [f"{name}={data[name]!r}: {why}" for name, (neutral, why) in unhonoured.items()
               if data.get(name) is not None and not neutral(data[name])]
    unknown = sorted(name for name, value in data.items()
                     if value is not None and name not in model.model_fields and name not in unhonoured)
    if unknown:
        refused.append(f"{', '.join(map(repr, unknown))}: unknown {what} field; the gateway refuses what it cannot "
                       f"honour rather than ignore it (known: {', '.join(sorted(model.model_fields))})")
    if refused:
        raise ValueError("; ".join(refused))
    return data


# Token-native turn ------------------------------------------------------------------------------
TOKEN_NATIVE_UNHONOURED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "text": (_absent, "the token-native endpoint takes input_ids (POST .../v1/chat/completions renders text)"),
    "rid": (_absent, "the gateway names engine requests itself (an id derived from the session would leak it)"),
    "logprob_start_len": (lambda v: v == -1, "prompt log-probs are not returned"),
    "return_routed_experts": (_empty, "routed experts are stored with the sample when the gateway runs with "
                                      "--routing-replay; the reply does not carry them"),
    "return_hidden_states": (_empty, "hidden states are not returned"),
}
"""SGLang /generate fields the gateway refuses at any value but their neutral one (field -> neutral?, why)."""


class SessionGenerateRequest(_IgnoresUnknown):
    """POST /sessions/{sid}/generate: engine /generate shape; input_ids are appended to the history."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input_ids: Annotated[list[Annotated[int, Field(ge=0)]], LongIds] = Field(min_length=0)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    """SGLang sampling params; the chat template's stop tokens are not added (token-native callers decide).
    gateway/sampling.py checks them (check_sampling: types and ranges as the engine's SamplingParams, unknown,
    reshaping and, by policy, truncating ones)."""
    return_logprob: bool = True
    top_logprobs_num: int = Field(0, ge=0, le=20)
    """meta_info.output_top_logprobs: the top alternatives of each output token (return_logprob needed)."""
    return_text_in_logprobs: bool = False
    """Log-prob entries carry their token's text ([logprob, id, text]) instead of None."""
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _honoured_or_refused(cls, data: Any) -> Any:
        return _refuse_unhonoured(cls, data, TOKEN_NATIVE_UNHONOURED, "token-native /generate")

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "SessionGenerateRequest":
        if self.top_logprobs_num and not self.return_logprob:
            raise ValueError(f"top_logprobs_num={self.top_logprobs_num}: needs return_logprob=true")
        return self


# OpenAI Chat Completions (request) ---------------------------------------------------------------
_ONE_USER = "the gateway keeps no per-user records (the session id identifies the episode)"
CHAT_UNHONOURED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_empty, "deprecated function calling: send tools"),
    "function_call": (_absent, "deprecated function calling: send tool_choice"),
    "audio": (_empty, "the model writes text only"),
    "modalities": (lambda v: v == ["text"] or not v, "the model writes text only"),
    "prediction": (_empty, "predicted outputs are not implemented"),
    "reasoning_effort": (_absent, "GLM's thinking is on or off per gateway (--no-thinking), not graded per request"),
    "verbosity": (_absent, "the model has no verbosity control"),
    "web_search_options": (_absent, "the gateway has no web search"),
    "store": (_empty, "the gateway stores no completions for retrieval (the session record is GET /sessions/{sid})"),
    "metadata": (_empty, "metadata tags stored completions, and the gateway stores none (episode metadata goes "
                         "into POST /sessions)"),
    "service_tier": (lambda v: v in ("auto", "default"), "the gateway has one service tier"),
    "prompt_cache_key": (_absent, "the gateway routes every turn of a session to the engine holding its prefix"),
    "prompt_cache_retention": (_absent, "the engines' prefix caches are not controlled per request"),
    "user": (_absent, _ONE_USER),
    "safety_identifier": (_absent, _ONE_USER),
}
"""OpenAI request fields the gateway refuses at any value but their neutral one (field -> neutral?, why).
Fields that change the sampling distribution (penalties, logit_bias, response_format) are declared below
and refused by the sampling policy (gateway/sampling.py), so that token-native turns get the same answer."""

TOOL_CHOICES = ("none", "auto", "required")


class ChatCompletionRequest(_IgnoresUnknown):
    """OpenAI's Chat Completions request. Every field a client sends is honoured or refused with a 400
    naming it (docs/gateway.md has the table): unknown fields and CHAT_UNHONOURED ones here, the
    distribution-changing ones by check_sampling."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    model: Optional[str] = None
    """Any name: a session serves its run's policy (GET /v1/models lists the name it answers with)."""
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    """none | auto | required | {"type": "function", "function": {"name": ...}} (gateway/openai_api.ToolPlan)."""
    parallel_tool_calls: Optional[bool] = None
    """false: the reply ends after its first tool call (the call's </tool_call> is a stop token)."""
    # Sampling fields: strict types (no "0.7" for 0.7, no true for 1) and OpenAI's ranges, a 400 naming the
    # field, before anything reaches an engine (where a bad value could fail the engine's whole batch).
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, strict=True)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, strict=True)
    top_k: Optional[int] = Field(None, ge=-1, strict=True)
    """Extension (SGLang's): -1 disables."""
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0, strict=True)
    """Extension (SGLang's): 0 disables."""
    max_tokens: Optional[int] = Field(None, ge=0, strict=True)
    max_completion_tokens: Optional[int] = Field(None, ge=0, strict=True)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED, strict=True)
    """The engine's sampling_seed: a uint64."""
    n: Optional[int] = Field(None, strict=True)
    stream: bool = Field(False, strict=True)
    stream_options: Optional[dict[str, Any]] = None
    logprobs: Optional[bool] = Field(None, strict=True)
    top_logprobs: Optional[int] = Field(None, ge=0, le=20, strict=True)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0, strict=True)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0, strict=True)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, strict=True)
    """Extension (SGLang's / vLLM's)."""
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _honoured_or_refused(cls, data: Any) -> Any:
        return _refuse_unhonoured(cls, data, CHAT_UNHONOURED, "OpenAI Chat Completions")

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

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, options: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        unknown = sorted(set(options or {}) - {"include_usage", "include_obfuscation"})
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))}: the gateway honours include_usage only")
        if (options or {}).get("include_obfuscation"):
            raise ValueError("include_obfuscation=true: the gateway does not pad chunks (it serves no browser)")
        return options

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true (as OpenAI answers)")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs}: needs logprobs=true")
        self._check_tool_choice()
        return self

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return
        if isinstance(choice, str) and choice != "required":
            raise ValueError(f"tool_choice={choice!r}: one of {', '.join(TOOL_CHOICES)} or "
                             "{'type': 'function', 'function': {'name': ...}}")
        if isinstance(choice, dict):
            function = choice.get("function")
            if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                    function.get("name"), str) or set(choice) - {"type", "function"}:
                raise ValueError(f"tool_choice={choice!r}: the gateway honours a named function only, "
                                 "{'type': 'function', 'function': {'name': ...}} (not allowed_tools or custom tools)")
        specs = [tool.get("function", tool) if isinstance(tool, dict) else {} for tool in self.tools or []]
        names = [spec.get("name") for spec in specs if isinstance(spec, dict)]
        if not names:
            raise ValueError(f"tool_choice={choice!r}: needs tools")
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise ValueError(f"tool_choice names {choice['function']['name']!r}, which is not among the tools {names}")

    @property
    def forced_tool(self) -> Optional[str]:
        """The function tool_choice names, if it names one."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
