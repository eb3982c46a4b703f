"""OpenAI Chat Completions on top of a token turn: sampling mapping, tool_choice, replies, streaming deltas.

Replies are plain dicts in OpenAI's shapes (`chat.completion`, `chat.completion.chunk`), serialised
with orjson: the official `openai` client parses them unchanged. The assistant message is parsed
from the output tokens with the chat template (tool calls from GLM's tool-call syntax); the
message returned to the client is also what the session compares the next request against.

tool_choice is honoured without touching the distribution the tokens are drawn from (a constrained decoder
would, and the trainer could not recompute it): `required` and a named function by writing the opening of
the call for the model (`<tool_call>`, then the name), once its reasoning is done; `none` by stopping the
turn at `<tool_call>`; parallel_tool_calls=false by stopping after the first `</tool_call>` (ToolPlan).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.protocols.engine import MAX_SEED
from asyncrl.protocols.gateway import ChatCompletionRequest, SessionSampling
from asyncrl.tokenizer import Tokenizer


def first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def turn_sampling(defaults: SessionSampling, turn_index: int, *, temperature=None, top_p=None, top_k=None,
                  min_p=None, max_new_tokens=None, seed=None) -> dict[str, Any]:
    """SGLang sampling params of one turn: the request's values, else the session's defaults.
    A session seed s gives turn k the seed s + k modulo 2**64 (reproducible, yet turns differ; a uint64)."""
    if seed is None and defaults.sampling_seed is not None:
        seed = (defaults.sampling_seed + turn_index) % (MAX_SEED + 1)
    params = {"temperature": first(temperature, defaults.temperature), "top_p": first(top_p, defaults.top_p),
              "top_k": first(top_k, defaults.top_k), "min_p": first(min_p, defaults.min_p),
              "max_new_tokens": first(max_new_tokens, defaults.max_new_tokens),
              "sampling_seed": seed}
    return {k: v for k, v in params.items() if v is not None}


@dataclass(frozen=True)
class ToolPlan:
    """How a turn honours tool_choice and parallel_tool_calls, in tokens."""

    forced: tuple[int, ...] = ()
    """Written for the model (mask 0): `<tool_call>` for required, `<tool_call>{name}` for a named function."""
    forced_after: Optional[int] = None
    """The model's token the forced ones follow (</think> with thinking on: it reasons first); None: at once."""
    stops: tuple[int, ...] = ()
    """Extra stop tokens: `<tool_call>` for none, `</tool_call>` for parallel_tool_calls=false."""
    hidden_stop: Optional[int] = None
    """A stop token that ends the turn but is not part of the message (none's `<tool_call>`)."""


def tool_plan(template: GlmChatTemplate, request: ChatCompletionRequest) -> ToolPlan:
    tokenizer = template.tokenizer
    open_call, close_call = tokenizer.token_id("<tool_call>"), tokenizer.token_id("</tool_call>")
    stops = (close_call,) if request.parallel_tool_calls is False else ()
    if request.tool_choice == "none":
        return ToolPlan(stops=(*stops, open_call), hidden_stop=open_call)
    if request.tool_choice == "required" or request.forced_tool is not None:
        name = tokenizer.encode(request.forced_tool, allow_special=False) if request.forced_tool else []
        after = None if not template.thinking else tokenizer.token_id("</think>")
        return ToolPlan(forced=(open_call, *name), forced_after=after, stops=stops)
    return ToolPlan(stops=stops)


def chat_sampling(request: ChatCompletionRequest, defaults: SessionSampling, turn_index: int,
                  stop_token_ids: Sequence[int]) -> dict[str, Any]:
    params = turn_sampling(defaults, turn_index, temperature=request.temperature, top_p=request.top_p,
                           top_k=request.top_k, min_p=request.min_p, max_new_tokens=first(request.max_completion_tokens, request.max_tokens),
                           seed=request.seed)
    params["stop_token_ids"] = list(stop_token_ids)
    if request.stop_strings:
        params["stop"] = request.stop_strings
    # What changes the distribution is put here under the request's own names, for check_sampling to refuse
    # (or to drop, at a neutral value) with the truncating fields: one policy for every API.
    distribution = {"frequency_penalty": request.frequency_penalty,
                    "presence_penalty": request.presence_penalty, "repetition_penalty": request.repetition_penalty,
                    "logit_bias": request.logit_bias, "response_format": request.response_format}
    params.update({name: value for name, value in distribution.items() if value is not None})
    return params


class ChatReply:
    """Turns output ids into the OpenAI assistant message (and, while streaming, its deltas)."""

    def __init__(self, template: GlmChatTemplate, request: ChatCompletionRequest, turn_index: int,
                 plan: ToolPlan = ToolPlan()) -> None:
        self.template = template
        self.tools = request.tools
        self.stops = request.stop_strings
        self.call_prefix = f"call_{turn_index}"
        self.hidden_stop = plan.hidden_stop
        self._open_call = template.tokenizer.token_id("<tool_call>")
        self._close_call = template.tokenizer.token_id("</tool_call>")
        self.sent = {"content": "", "reasoning_content": ""}

    def message(self, output_ids: Sequence[int]) -> dict[str, Any]:
        """The final assistant message: content cut at a stop string, tool calls parsed."""
        message = self.template.parse_assistant(self._message_ids(output_ids), self.tools, self.call_prefix).to_openai()
        if message["content"]:
            message["content"] = _cut_at_stop(message["content"], self.stops)
        return message

    def parse_failures(self, output_ids: Sequence[int], message: dict[str, Any]) -> int:
        """Tool calls the output opened that did not parse (malformed, or cut off): <tool_call> ids before
        the stop, less the calls in the message."""
        ids = self._message_ids(output_ids)
        stop = next((i for i, t in enumerate(ids) if t in self.template.stop_token_ids), len(ids))
        return max(ids[:stop].count(self._open_call) - len(message.get("tool_calls") or []), 0)

    def deltas(self, output_ids: Sequence[int], final: bool) -> list[dict[str, Any]]:
        """Text not yet streamed, as chunk deltas. An unclosed tool call, the tail that could still
        become a stop string and an incomplete UTF-8 character at the end (a token may hold part of one:
        decoded, it is '\ufffd' until the rest arrives) are held back until they resolve, as SGLang's and
        vLLM's incremental detokenizers do; the final call emits the rest, so the deltas add up to message().
        Tool calls come in the final delta."""
        ids = self._message_ids(output_ids) if final else self._before_open_call(output_ids)
        parsed = self.template.parse_assistant(ids, self.tools, self.call_prefix)
        visible = {"reasoning_content": parsed.reasoning_content,
                   "content": _cut_at_stop(parsed.content, self.stops, hold_back=not final)}
        if not final:
            visible = {field: text.rstrip(REPLACEMENT_CHAR) for field, text in visible.items()}
        deltas = []
        for field, text in visible.items():
            if text.startswith(self.sent[field]) and len(text) > len(self.sent[field]):
                deltas.append({field: text[len(self.sent[field]):]})
                self.sent[field] = text
        if final and parsed.tool_calls:
            calls = [{"index": i, **call.to_openai()} for i, call in enumerate(parsed.tool_calls)]
            deltas.append({"tool_calls": calls})
        return deltas

    def _message_ids(self, output_ids: Sequence[int]) -> list[int]:
        """The ids the message is parsed from: output_ids less a hidden stop token at the end."""
        ids = list(output_ids)
        return ids[:-1] if self.hidden_stop is not None and ids[-1:] == [self.hidden_stop] else ids

    def _before_open_call(self, ids: Sequence[int]) -> list[int]:
        """ids up to a <tool_call> that is not closed yet."""
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == self._close_call:
                break
            if ids[i] == self._open_call:
                return list(ids[:i])
        return list(ids)


REPLACEMENT_CHAR = "\ufffd"
"""What decoding gives for bytes that are not (yet) a whole UTF-8 character."""


def _cut_at_stop(text: str, stops: Sequence[str], hold_back: bool = False) -> str:
    """Text before the first stop string; while streaming, also hold back a tail that may start one."""
    for stop in stops:
        if stop and stop in text:
            text = text[:text.index(stop)]
    if hold_back and stops:
        longest = max(len(stop) for stop in stops)
        text = text[:max(0, len(text) - longest + 1)]
    return text


def finish_reason(message: dict[str, Any], engine_finish: str) -> str:
    if message.get("tool_calls"):
        return "tool_calls"
    return "length" if engine_finish == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` is what the engine's prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_logprobs(tokenizer: Tokenizer, output_ids: Sequence[int], logprobs: Sequence[float],
                   top_logprobs: Sequence[Sequence[tuple[float, int]]] = ()) -> dict[str, Any]:
    """OpenAI `choices[0].logprobs` of the generated tokens, each with its top alternatives when asked.
    `bytes` are the token's own bytes (part of a UTF-8 character for some tokens)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokenizer.decode([token_id]), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}

    tops = list(top_logprobs) or [[] for _ in output_ids]
    content = [{**entry(token_id, logprob), "top_logprobs": [entry(i, lp) for lp, i in top]}
               for token_id, logprob, top in zip(output_ids, logprobs, tops)]
    return {"content": content, "refusal": None}


def chat_completion(completion_id: str, model: str, message: dict[str, Any], finish: str,
                    usage_: dict[str, Any], logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage_}


def chat_chunk(completion_id: str, model: str, delta: Optional[dict[str, Any]], finish: Optional[str] = None,
               usage_: Optional[dict[str, Any]] = None, logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One `chat.completion.chunk`; delta None gives the usage-only chunk (choices [])."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk
