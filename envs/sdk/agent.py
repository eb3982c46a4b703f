"""A tool-calling agent loop as an explicit state machine over the OpenAI Chat Completions API.

    ASK ──(reply has tool calls)──> ACT ──(no tool ended the episode)──> ASK
     │                               └──(a tool returned done)──> FINISHED
     ├──(reply has no tool call)──> FINISHED
     ├──(reply has no tool call and was cut at max_tokens)──> OUT_OF_TOKENS
     └──(max_turns model calls made)──> OUT_OF_TURNS

ASK sends the conversation and the tool schemas to the model; ACT executes each tool call and
appends its observation as a `role: "tool"` message. Mistakes of the agent (unknown tool, arguments
that are not JSON or miss a field) become observations it can react to; exceptions raised by a tool
itself mean the environment broke and propagate (the episode is reported failed). OUT_OF_TURNS and
OUT_OF_TOKENS are the model's doing: `LoopOutcome.status` / `.reason` report them as truncated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Union

from asyncrl.protocols.env_service import OUTCOMES, EpisodeReason, EpisodeStatus
from envs.sdk.base import EpisodeContext

if TYPE_CHECKING:
    from openai import AsyncOpenAI


@dataclass
class ToolResult:
    output: str
    done: bool = False
    """True ends the episode after this call (submit, answer)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object (type object, properties, required)."""
    run: Callable[..., Awaitable[Union[str, ToolResult]]]
    """Called with the parsed arguments as keyword arguments."""

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


def schema(properties: dict[str, str], required: Optional[list[str]] = None) -> dict[str, Any]:
    """A JSON schema for string-typed tool arguments: {name: description}; all required by default."""
    return {"type": "object",
            "properties": {name: {"type": "string", "description": desc} for name, desc in properties.items()},
            "required": list(properties) if required is None else required}


class AgentLoop:
    def __init__(self, llm: "AsyncOpenAI", ctx: EpisodeContext, tools: list[Tool], max_observation_chars: int = 8000):
        self.llm = llm
        self.ctx = ctx
        self.tools = {tool.name: tool for tool in tools}
        self.max_observation_chars = max_observation_chars

    async def run(self, messages: list[dict[str, Any]]) -> LoopOutcome:
        """Drive the conversation (appended to in place) until FINISHED, OUT_OF_TURNS or OUT_OF_TOKENS."""
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
            messages=messages, tools=[t.schema() for t in self.tools.values()], **self.ctx.completion_args())
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
            messages.append({"role": "tool", "tool_call_id": call.id, "content": self._clip(result.output)})
            if result.done:
                return True
        return False

    async def _call(self, name: str, arguments: str) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"error: unknown tool {name!r}; available tools: {', '.join(self.tools)}")
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as err:
            return ToolResult(f"error: the arguments of {name} are not valid JSON ({err})")
        problem = _argument_problem(tool.parameters, args)
        if problem:
            return ToolResult(f"error: {name}: {problem}")
        result = await tool.run(**args)
        return result if isinstance(result, ToolResult) else ToolResult(result)

    def _clip(self, text: str) -> str:
        cap = self.max_observation_chars
        return text if len(text) <= cap else text[:cap] + f"\n[... {len(text) - cap} more characters cut]"


def _argument_problem(parameters: dict[str, Any], args: Any) -> Optional[str]:
    if not isinstance(args, dict):
        return "arguments must be a JSON object"
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in args]
    unknown = [k for k in args if k not in properties]
    wrong = [k for k, spec in properties.items() if k in args and spec.get("type") == "string"
             and not isinstance(args[k], str)]
    if missing or unknown or wrong:
        return "; ".join(filter(None, [missing and f"missing argument(s) {missing}",
                                       unknown and f"unknown argument(s) {unknown}",
                                       wrong and f"argument(s) {wrong} must be strings"]))
    return None
