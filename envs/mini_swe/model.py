"""mini-swe-agent's Model over the episode's gateway session: its queries become chat completions on
the `llm` the SDK hands run_episode (its base URL is the gateway session), with the episode's sampling
(`ctx.completion_args()`), and the replies' bash tool calls become its actions.

Action parsing and observation formatting are mini-swe-agent's own (models/utils/actions_toolcall.py,
the functions its LiteLLM model uses); only the transport is ours, so litellm is not needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from minisweagent.exceptions import FormatError
from minisweagent.models.utils.actions_toolcall import (BASH_TOOL, format_toolcall_observation_messages,
                                                        parse_toolcall_actions)
from pydantic import BaseModel

from envs.mini_swe.bridge import LoopBridge
from envs.sdk import EpisodeContext
from envs.sdk.context import ContextManager

if TYPE_CHECKING:
    from openai import AsyncOpenAI


class GatewayModelConfig(BaseModel):
    """The `model:` section of a mini-swe-agent config; its LiteLLM keys (model_name, model_kwargs) are
    ignored: the episode's request names the model and its sampling."""

    observation_template: str
    """How a command's result is shown to the model (jinja2 over `output`)."""
    format_error_template: str
    """What the model is told when its reply has no valid bash tool call."""


class GatewayModel:
    def __init__(self, llm: "AsyncOpenAI", ctx: EpisodeContext, bridge: LoopBridge, **config: Any):
        self.config = GatewayModelConfig(**config)
        self.llm, self.ctx, self.bridge = llm, ctx, bridge
        self.context = ContextManager(ctx.context_policy, ctx.context_log)
        """The env's context management, applied to the agent's own history (edited in place)."""
        self.last_finish_reason: Optional[str] = None
        """finish_reason of the latest reply ("length": cut at max_tokens)."""

    def query(self, messages: list[dict], **kwargs: Any) -> dict:
        """One chat completion; the assistant message with its bash actions under `extra`. A reply without a
        valid bash call raises FormatError (the agent shows the model the error and asks again) carrying
        the reply itself first: the conversation keeps what the model said, so the next turn extends the
        gateway's token sequence instead of opening a new one without it."""
        sent = self.context.before_call(messages)
        response = self.bridge.call(self.llm.chat.completions.create(
            messages=[{k: v for k, v in m.items() if k != "extra"} for m in sent], tools=[BASH_TOOL],
            **self.ctx.completion_args()))
        self.context.after_call(response.usage, len(messages) + 1)
        choice = response.choices[0]
        self.last_finish_reason = choice.finish_reason
        reply: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
        if choice.message.tool_calls:
            reply["tool_calls"] = [call.model_dump(include={"id", "type", "function"})
                                   for call in choice.message.tool_calls]
        extra = {"response": response.model_dump(mode="json"), "cost": 0.0}
        try:
            actions = parse_toolcall_actions(choice.message.tool_calls or [],
                                             format_error_template=self.config.format_error_template,
                                             template_kwargs={"finish_reason": choice.finish_reason})
        except FormatError as err:
            err.messages = ({**reply, "extra": extra}, *err.messages)
            raise
        return {**reply, "extra": {"actions": actions, **extra}}

    def format_message(self, **kwargs: Any) -> dict:
        return dict(kwargs)

    def format_observation_messages(self, message: dict, outputs: list[dict],
                                    template_vars: Optional[dict] = None) -> list[dict]:
        return format_toolcall_observation_messages(
            actions=message.get("extra", {}).get("actions", []), outputs=outputs,
            observation_template=self.config.observation_template, template_vars=template_vars)

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return self.config.model_dump()

    def serialize(self) -> dict:
        return {"info": {"config": {"model": self.config.model_dump(mode="json"),
                                    "model_type": f"{type(self).__module__}.{type(self).__name__}"}}}
