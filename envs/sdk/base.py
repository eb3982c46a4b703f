"""The one interface an environment author implements: list tasks, run one episode.

Everything else a service needs (HTTP app, capacity, cancellation, deadlines, registration, the
sandbox) is supplied by the SDK around these two methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from asyncrl.protocols.env_service import EpisodeReason, EpisodeStatus
from envs.sdk.context import ContextLog, ContextPolicy

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from envs.sdk.sandbox import Sandbox


@dataclass
class ToolLog:
    """The tool calls an episode's agent made (EpisodeResult.info "tools"; the trainer's agent metrics). The
    AgentLoop records every call it executes or refuses; an env with a loop of its own calls `record`."""

    calls: int = 0
    errors: int = 0
    """Calls that failed: refused by the loop (unknown tool, arguments that are not JSON or do not fit the
    tool's parameters) or reported failed by the tool (ToolResult.error)."""
    by_tool: dict[str, int] = field(default_factory=dict)

    def record(self, tool: str, error: bool) -> None:
        self.calls += 1
        self.errors += int(error)
        self.by_tool[tool] = self.by_tool.get(tool, 0) + 1

    def summary(self) -> dict[str, Any]:
        return {"calls": self.calls, "errors": self.errors, "by_tool": dict(self.by_tool)}


@dataclass(frozen=True)
class EpisodeContext:
    """What the request says about this episode, beyond the task id."""

    episode_id: str
    task_id: str
    seed: int
    max_turns: int
    """Model calls the agent may make; agents stop asking after this many and report truncated."""
    deadline_s: float
    model: str
    sampling: dict[str, Any] = field(default_factory=dict)
    """temperature, top_p, max_tokens and any extra sampling keys of the request."""
    context_policy: Optional[ContextPolicy] = None
    """How the AgentLoop edits a long conversation (the env's `context` config, envs/sdk/context.py); None:
    never. An env with a loop of its own applies it the same way."""
    context_log: ContextLog = field(default_factory=ContextLog)
    """Per-call context sizes and the policy's edits; the SDK reports them (info "context", /metrics)."""
    tool_log: ToolLog = field(default_factory=ToolLog)
    """Tool calls and tool errors; the SDK reports them (info "tools", /metrics)."""

    def completion_args(self) -> dict[str, Any]:
        """Keyword arguments for `llm.chat.completions.create` besides messages and tools."""
        typed = {k: self.sampling[k] for k in ("temperature", "top_p", "max_tokens") if k in self.sampling}
        extra = {k: v for k, v in self.sampling.items() if k not in typed}
        return {"model": self.model, **typed, **({"extra_body": extra} if extra else {})}


@dataclass
class EpisodeResult:
    """What the environment makes of an episode the model played: always a model outcome (trained).
    Raise instead when the environment or its infrastructure broke (docs/envs.md "Outcomes")."""

    reward: float
    status: EpisodeStatus = EpisodeStatus.completed
    """completed, or truncated when the model ran out of turns or tokens."""
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable details (parsed answer, verifier output, ...), returned to the caller."""
    reason: Optional[EpisodeReason] = None
    """completed, max_turns or max_tokens; None means completed for a completed result and max_turns
    for a truncated one (`LoopOutcome.reason` is the AgentLoop's)."""
    num_turns: Optional[int] = None
    """Model calls the env made through a client of its own instead of `llm` (verifiers' interception
    server); None: the SDK's count of the calls answered through `llm`."""


class Environment(ABC):
    """An environment: a set of tasks and an agent loop that plays one of them and scores it.

    Subclasses take their options as keyword arguments of __init__ (the service's `options`).
    Exceptions escaping run_episode mean the environment broke: the SDK reports status "failed" with
    the reason the exception names (SandboxError: sandbox_error, an openai.APIError: llm_error,
    anything else: env_error), and the sample is not trained.
    """

    name: ClassVar[str]
    """Default service name (`--name` / the run config's key override it); unset: the class name."""
    domain: ClassVar[str]
    """Default domain (orchestrator weights can be set per domain; `--domain` overrides it); unset: the
    service name."""
    version: ClassVar[str] = "1"
    requires_sandbox: ClassVar[bool] = False
    """True when episodes execute agent-controlled code: the service then refuses to start without
    an isolating sandbox unless the operator chose the unsafe local one."""
    reward_range: tuple[float, float] = (-100.0, 100.0)
    """The rewards this env can return, bounds included: a reward outside it (1e30 from a grader's bug) is
    an env_error like NaN, never trained. An env with larger rewards widens it (class or instance)."""
    splits: tuple[str, ...] = ("train",)
    """The task splits `list_tasks` serves. `train` is what RL trains on; an env with held-out tasks
    (what `asyncrl eval` scores) adds `eval` and takes `split` in list_tasks. Splits must not share task
    ids (the service checks), nor, for a held-out split to mean anything, problems. May be set per
    instance (an option that turns the held-out split off)."""

    @abstractmethod
    async def list_tasks(self, split: str = "train") -> list[str]:
        """All task ids of `split` (one of `splits`), in a stable order (the orchestrator pages through
        the train split). An env without held-out tasks may leave `split` out of its signature: the SDK
        only passes it for splits other than train."""

    @abstractmethod
    async def run_episode(self, task_id: str, llm: "AsyncOpenAI", sandbox: Optional["Sandbox"],
                          ctx: EpisodeContext) -> EpisodeResult:
        """Play task `task_id` with the model behind `llm` and return its reward.

        `sandbox` is a fresh per-episode sandbox when `requires_sandbox`, else None. Model calls go
        through `llm.chat.completions.create(messages=..., tools=..., **ctx.completion_args())`.
        """
