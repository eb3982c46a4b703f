"""A tool-calling agent loop as an explicit state machine over the OpenAI Chat Completions API.

    ASK ──(reply has tool calls)──> ACT ──(no tool ended the episode)──> ASK
     │                               └──(a tool returned done)──> FINISHED
     ├──(reply has no tool call)──> FINISHED
     ├──(reply has no tool call and was cut at max_tokens)──> OUT_OF_TOKENS
     └──(max_turns model calls made)──> OUT_OF_TURNS

ASK sends the conversation and the tool schemas to the model; ACT executes each tool call and
appends its observation as a `role: "tool"` message. Mistakes of the agent (unknown tool, arguments
that are not JSON, or that do not fit the tool's parameters: envs/sdk/param.py) become observations
it can react to, and the tool is not called; exceptions raised by a tool itself mean the environment
broke and propagate (the episode is reported failed). OUT_OF_TURNS and
OUT_OF_TOKENS are the model's doing: `LoopOutcome.status` / `.reason` report them as truncated.

Before every ASK but the first, the episode's context policy (envs/sdk/context.py: keep-recent-k,
discard-all, one's own; `EpisodeContext.context_policy`) may edit the conversation; each call's prompt
size and the policy's edits go to `EpisodeContext.context_log`.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Union

from asyncrl.protocols.env_service import OUTCOMES, EpisodeReason, EpisodeStatus
from envs.sdk.base import EpisodeContext
from envs.sdk.context import ContextManager
from envs.sdk.param import check_arguments, schema

__all__ = ["AgentLoop", "LoopOutcome", "Phase", "Tool", "ToolResult", "schema"]

if TYPE_CHECKING:
    from openai import AsyncOpenAI


@dataclass
class ToolResult:
    output: str
    done: bool = False
    """True ends the episode after this call (submit, answer)."""
    error: bool = False
    """The call failed (a command's non-zero exit, a lookup that found nothing): the agent sees `output`
    as usual; the episode's tool log counts it as a tool error."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object (type object, properties, required): `schema(...)`."""
    run: Callable[..., Awaitable[Union[str, ToolResult]]]
    """Called with the checked arguments as keyword arguments (defaults filled in)."""

    def __post_init__(self) -> None:
        problem = _signature_problem(self.run, self.parameters)
        if problem:
            raise ValueError(f"tool {self.name!r}: {problem}")

    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class Phase(Enum):
    ASK = "ask"
    ACT = "act"
    FINISHED = "finished"
    OUT_OF_TURNS = "out_of_turns"
    OUT_OF_TOKENS = "out_of_tokens"


_PHASE_REASONS = {Phase.FINISHED: EpisodeReason.completed, Phase.OUT_OF_TURNS: EpisodeReason.max_turns,
                  Phase.OUT_OF_TOKENS: EpisodeReason.max_tokens}


@dataclass
class LoopOutcome:
    phase: Phase
    """FINISHED, OUT_OF_TURNS or OUT_OF_TOKENS."""
    turns: int
    """Model calls made."""
    final_text: Optional[str]
    """Content of the last model reply when it ended without a tool call (cut or not)."""
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def reason(self) -> EpisodeReason:
        """completed, max_turns or max_tokens: what to put into EpisodeResult.reason."""
        return _PHASE_REASONS[self.phase]

    @property
    def status(self) -> EpisodeStatus:
        """completed, or truncated when the model ran out of turns or tokens."""
        return OUTCOMES[self.reason][1]


class AgentLoop:
    def __init__(self, llm: "AsyncOpenAI", ctx: EpisodeContext, tools: list[Tool], max_observation_chars: int = 8000):
        self.llm = llm
        self.ctx = ctx
        self.tools = {tool.name: tool for tool in tools}
        self.max_observation_chars = max_observation_chars
        self.context = ContextManager(ctx.context_policy, ctx.context_log)

    async def run(self, messages: list[dict[str, Any]]) -> LoopOutcome:
        """Drive the conversation (appended to in place; replaced in place when the context policy edits
        it) until FINISHED, OUT_OF_TURNS or OUT_OF_TOKENS."""
        phase, turns, reply = Phase.ASK, 0, None
        while phase in (Phase.ASK, Phase.ACT):
            if phase is Phase.ASK:
                if turns >= self.ctx.max_turns:
                    phase = Phase.OUT_OF_TURNS
                    break
                reply, cut = await self._ask(messages)
                turns += 1
                phase = Phase.ACT if reply.tool_calls else Phase.OUT_OF_TOKENS if cut else Phase.FINISHED
            else:
                phase = Phase.FINISHED if await self._act(reply.tool_calls, messages) else Phase.ASK
        ended_by_reply = phase in (Phase.FINISHED, Phase.OUT_OF_TOKENS) and reply is not None and not reply.tool_calls
        return LoopOutcome(phase, turns, reply.content if ended_by_reply else None, messages)

    async def _ask(self, messages: list[dict[str, Any]]):
        """The model's reply, appended to the conversation, and whether max_tokens cut it."""
        response = await self.llm.chat.completions.create(
            messages=self.context.before_call(messages), tools=[t.schema() for t in self.tools.values()],
            **self.ctx.completion_args())
        self.context.after_call(response.usage, len(messages) + 1)
        choice = response.choices[0]
        reply = choice.message
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [call.model_dump(include={"id", "type", "function"}) for call in reply.tool_calls]
        messages.append(message)
        return reply, choice.finish_reason == "length"

    async def _act(self, tool_calls, messages: list[dict[str, Any]]) -> bool:
        """Run the calls in order; True when one of them ended the episode (later calls are skipped)."""
        for call in tool_calls:
            result = await self._call(call.function.name, call.function.arguments)
            self.ctx.tool_log.record(call.function.name, result.error)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": self._clip(result.output)})
            if result.done:
                return True
        return False

    async def _call(self, name: str, arguments: str) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"error: unknown tool {name!r}; available tools: {', '.join(self.tools)}", error=True)
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as err:
            return ToolResult(f"error: the arguments of {name} are not valid JSON ({err})", error=True)
        args, problems = check_arguments(tool.parameters, args)
        if problems:
            return ToolResult(f"error: {name}: {'; '.join(problems)}", error=True)
        result = await tool.run(**args)
        return result if isinstance(result, ToolResult) else ToolResult(result)

    def _clip(self, text: str) -> str:
        cap = self.max_observation_chars
        return text if len(text) <= cap else text[:cap] + f"\n[... {len(text) - cap} more characters cut]"


def _signature_problem(run: Callable[..., Any], parameters: dict[str, Any]) -> Optional[str]:
    """What makes valid arguments crash the call: a property `run` does not accept, or a parameter of
    `run` without a default that the schema lets the model leave out."""
    try:
        signature = inspect.signature(run)
    except (TypeError, ValueError):  # not introspectable (a builtin, a C callable): trust it
        return None
    accepted = {n: p for n, p in signature.parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    properties = parameters.get("properties", {}) or {}
    required = set(parameters.get("required", []) or [])
    not_accepted = [n for n in properties if n not in accepted and not takes_any]
    if not_accepted:
        return f"the function does not take the argument(s) {not_accepted} its parameters declare"
    unfilled = [n for n, p in accepted.items() if p.default is p.empty and n not in required
                and not (isinstance(properties.get(n), dict) and "default" in properties[n])]
    if unfilled:
        return (f"the function needs the argument(s) {unfilled}, which its parameters "
                f"{'make optional' if all(n in properties for n in unfilled) else 'do not declare'}; "
                "give them a default in the function or make them required")
    return None
