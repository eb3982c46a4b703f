"""GLM-5.1 chat template rendered straight to token ids, its incremental form, and the reply parser.

Layout (the GLM-5.1 / glm_moe_dsa chat template; see docs/chat_template.md for a full example):

    [gMASK]<sop>
    <|system|>\\n# Tools ... <tools>\\n{json of each function}\\n</tools> ... XML format:\\n<tool_call>...
    <|system|>{content}          <|user|>{content}
    <|assistant|><think>{reasoning}</think>{content}<tool_call>{name}<arg_key>{k}</arg_key>
        <arg_value>{v}</arg_value>...</tool_call>       (no newlines: one line in the token stream)
    <|observation|><tool_response>{content}</tool_response><tool_response>...  (a run of `tool` messages)
    generation prompt: <|assistant|><think>   (thinking=False: <|assistant|></think>)

The model ends an assistant turn by emitting the next role token: <|observation|> after tool calls,
<|user|> otherwise, or <|endoftext|>. Argument values that are strings are written raw, anything else
as JSON. Two deliberate differences from GLM's jinja template, both for token-in-token-out RL:
  * earlier assistant turns keep their reasoning (GLM's `clear_thinking=False`, the glm_moe_dsa
    variant's empty-think layout), so a rendering never changes when messages are appended;
  * message content is encoded with special-token strings as plain text (a tool output containing
    "<|user|>" stays text); only the template's own markers are special tokens.

Incremental rule (what the gateway relies on). A session keeps the messages rendered so far and the
exact token ids, the model's output tokens included as generated. `render_incremental` returns the
ids of the appended messages only, such that previous_ids + new_ids is what `render` gives for the
whole list, token for token, whenever the previous ids are canonical renderings:
  1. each appended message renders as in a full render; a `tool` message right after a `tool`
     message gets no <|observation|>;
  2. if the last rendered message is the model's assistant turn and previous_ids end with the role
     token the first appended message starts with (the model's stop token, e.g. <|observation|>
     before tool results), that token is not repeated;
  3. an assistant turn that ended another way (by length, no stop token, or with a stop token that
     is not the next message's role, e.g. <|user|> followed by tool results) keeps its tokens and
     the next message's role token follows them: the sequence stays an exact extension of what
     the model saw, it just differs from a fresh render of the parsed messages.
`appended_messages` tells whether a new message list extends the previous one (else the gateway
starts a new segment).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from asyncrl.tokenizer import Tokenizer

GLM_SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
)  # fmt: skip
"""GLM-4.5 / GLM-5.x reserved tokens in their vocabulary order (the tiny tokenizer ships them all)."""

TOOLS_PREAMBLE = (
    "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n"
)
TOOL_CALL_EXAMPLE = (
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)

_TEMPLATE_TOKENS = tuple(name for name in GLM_SPECIAL_TOKENS if name not in ("[MASK]", "[sMASK]", "<eop>"))
_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>",
            "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")  # fmt: skip
"""Tokens that structure an assistant turn; the parser splits model output at them."""
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>"}

Message = Mapping[str, Any]
"""An OpenAI chat message: {"role", "content", optional "tool_calls", "reasoning_content", ...}."""


class ChatTemplateError(ValueError):
    """A message or tool definition the template cannot render; the text says which and why."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class AssistantMessage:
    """An assistant turn parsed from model output."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def to_openai(self) -> dict[str, Any]:
        """OpenAI message; content is None for a tool-call-only turn, reasoning only when present."""
        content = self.content if self.content or not self.tool_calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


class GlmChatTemplate:
    """Renders OpenAI messages and tools to GLM-5.1 token ids and parses assistant output back."""

    def __init__(self, tokenizer: Tokenizer, thinking: bool = True):
        missing = [name for name in _TEMPLATE_TOKENS if not tokenizer.has_token(name)]
        if missing:
            raise ChatTemplateError(f"the tokenizer lacks GLM special tokens {missing}")
        self.tokenizer = tokenizer
        self.thinking = thinking
        self._id = {name: tokenizer.token_id(name) for name in _TEMPLATE_TOKENS}
        self._markers = {self._id[name]: name for name in _MARKERS}

    # ---- rendering -------------------------------------------------------------------------

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn: <|user|>, <|observation|>, <|endoftext|>."""
        return tuple(self._id[name] for name in ("<|user|>", "<|observation|>", "<|endoftext|>"))

    def stop_token_for(self, message: Message) -> int:
        """The stop token a model emits after this assistant message (what the next turn opens with)."""
        return self._id["<|observation|>" if message.get("tool_calls") else "<|user|>"]

    def generation_prompt(self) -> list[int]:
        """<|assistant|><think> (thinking) or <|assistant|></think>: the model continues from here."""
        return [self._id["<|assistant|>"], self._id["<think>" if self.thinking else "</think>"]]

    def render_reply(self, message: Message) -> list[int]:
        """The ids a model generates for this assistant message after `generation_prompt()`: its think
        block's rest, content and tool calls, without the stop token (`stop_token_for` gives it)."""
        return self._render_assistant_body(message, 0)[1:]  # the body's first id closes the generation prompt

    def render(
        self, messages: Sequence[Message], tools: Sequence[Mapping] | None = None, add_generation_prompt: bool = False
    ) -> list[int]:
        """Token ids of the whole conversation, from [gMASK]<sop> on."""
        ids = [self._id["[gMASK]"], self._id["<sop>"], *self._render_tools(tools)]
        ids += self._render_messages(messages, None)
        return ids + self.generation_prompt() if add_generation_prompt else ids

    def render_incremental(
        self,
        previous_messages: Sequence[Message],
        previous_ids: Sequence[int],
        new_messages: Sequence[Message],
        tools: Sequence[Mapping] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Ids to append after `previous_ids` for `new_messages` (rule in the module docstring).

        previous_ids are the session's tokens: the rendering of previous_messages, with the model's
        own output tokens (stop token included) for the assistant turns it generated. `tools` are
        rendered only when nothing was rendered yet (they belong to the opening system block).
        """
        if not previous_ids:
            return self.render(new_messages, tools, add_generation_prompt)
        last_role = _role(previous_messages[-1], len(previous_messages) - 1) if previous_messages else None
        prompt = self.generation_prompt()
        if last_role != "assistant" and list(previous_ids[-len(prompt):]) == prompt:
            raise ChatTemplateError("previous_ids end with a generation prompt but the assistant turn is "
                                    "missing: append the model's output and its parsed message first")
        ids = self._render_messages(new_messages, last_role)
        if ids and last_role == "assistant" and previous_ids[-1] == ids[0]:
            ids = ids[1:]  # the model already emitted this role token as its stop token
        return ids + prompt if add_generation_prompt else ids

    def _render_messages(self, messages: Sequence[Message], previous_role: str | None) -> list[int]:
        ids: list[int] = []
        for index, message in enumerate(messages):
            role = _role(message, index)
            ids += self._render_message(message, role, previous_role, index)
            previous_role = role
        return ids

    def _render_message(self, message: Message, role: str, previous_role: str | None, index: int) -> list[int]:
        if role == "assistant":
            return [self._id["<|assistant|>"], *self._render_assistant_body(message, index)]
        text = self._literal(_text(message.get("content"), index))
        if role == "tool":
            opener = [] if previous_role == "tool" else [self._id["<|observation|>"]]
            return [*opener, self._id["<tool_response>"], *text, self._id["</tool_response>"]]
        return [self._id[_ROLE_TOKENS[role]], *text]

    def _render_assistant_body(self, message: Message, index: int) -> list[int]:
        """Everything after <|assistant|>: think block, stripped content, tool calls."""
        reasoning = (message.get("reasoning_content") or "").strip()
        if reasoning or self.thinking:
            think = [self._id["<think>"], *self._literal(reasoning), self._id["</think>"]]
        else:
            think = [self._id["</think>"]]
        content = self._literal(_text(message.get("content"), index).strip())
        calls = [token for call in _tool_calls(message, index) for token in self._render_tool_call(call)]
        return think + content + calls

    def _render_tool_call(self, call: ToolCall) -> list[int]:
        ids = [self._id["<tool_call>"], *self._literal(call.name)]
        for key, value in call.arguments.items():
            ids += [self._id["<arg_key>"], *self._literal(key), self._id["</arg_key>"]]
            ids += [self._id["<arg_value>"], *self._literal(_format_value(value)), self._id["</arg_value>"]]
        return ids + [self._id["</tool_call>"]]

    def _render_tools(self, tools: Sequence[Mapping] | None) -> list[int]:
        if not tools:
            return []
        specs = "\n".join(json.dumps(_function_spec(tool, i), ensure_ascii=False) for i, tool in enumerate(tools))
        return [self._id["<|system|>"], *self._literal(TOOLS_PREAMBLE + specs + TOOLS_POSTAMBLE),
                *self.tokenizer.encode(TOOL_CALL_EXAMPLE)]  # fmt: skip

    def _literal(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, allow_special=False)

    # ---- parsing ---------------------------------------------------------------------------

    def parse_assistant(
        self, output_ids: Sequence[int], tools: Sequence[Mapping] | None = None, call_id_prefix: str = "call"
    ) -> AssistantMessage:
        """The assistant message in the model's output (generated after `generation_prompt()`).

        The output ends at its first stop token (dropped). With thinking on, the text before
        </think> is the reasoning; an output that never closes its think block (cut by length) is
        all reasoning. An argument the tool's schema types as "string" stays a string; other values
        are JSON-decoded when they parse. A malformed or unclosed tool call stays in the content as
        text. Tool-call ids are `{call_id_prefix}_{i}`.
        """
        ids = list(output_ids)
        stops = [i for i, token in enumerate(ids) if token in self.stop_token_ids]
        pieces = self._pieces(ids[: stops[0]] if stops else ids)
        reasoning, body = self._split_reasoning(pieces)
        content, calls = self._split_tool_calls(body, _string_arguments(tools), call_id_prefix)
        return AssistantMessage(content=content.strip(), reasoning_content=reasoning.strip(), tool_calls=calls)

    def parse_assistant_text(
        self, text: str, tools: Sequence[Mapping] | None = None, call_id_prefix: str = "call"
    ) -> AssistantMessage:
        """`parse_assistant` of text (e.g. an engine's decoded output with special tokens kept)."""
        return self.parse_assistant(self.tokenizer.encode(text), tools, call_id_prefix)

    def _pieces(self, ids: list[int]) -> list[int | str]:
        """Marker token ids as ints, the text between them decoded: [</think>, "hi", <tool_call>, ...]."""
        pieces: list[int | str] = []
        run: list[int] = []
        for token in ids + [None]:
            if token is None or token in self._markers:
                if run:
                    pieces.append(self.tokenizer.decode(run))
                    run = []
                if token is not None:
                    pieces.append(token)
            else:
                run.append(token)
        return pieces

    def _raw(self, pieces: Sequence[int | str]) -> str:
        return "".join(p if isinstance(p, str) else self._markers[p] for p in pieces)

    def _split_reasoning(self, pieces: list[int | str]) -> tuple[str, list[int | str]]:
        opener = _index(pieces, self._id["<think>"], 0)
        if opener is not None and not self._raw(pieces[:opener]).strip():
            pieces = pieces[opener + 1 :]  # the model opened the think block itself
        if self._id["</think>"] in pieces:
            end = pieces.index(self._id["</think>"])
            return self._raw(pieces[:end]), pieces[end + 1 :]
        return (self._raw(pieces), []) if self.thinking else ("", pieces)

    def _split_tool_calls(
        self, pieces: list[int | str], string_args: dict[str, set[str]], call_id_prefix: str
    ) -> tuple[str, tuple[ToolCall, ...]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        i = 0
        while i < len(pieces):
            if pieces[i] != self._id["<tool_call>"]:
                content.append(self._raw(pieces[i : i + 1]))
                i += 1
                continue
            end = _index(pieces, self._id["</tool_call>"], i + 1)
            call_id = f"{call_id_prefix}_{len(calls)}"
            call = None if end is None else self._parse_call(pieces[i + 1 : end], string_args, call_id)
            if call is None:
                stop = len(pieces) if end is None else end + 1
                content.append(self._raw(pieces[i:stop]))
                i = stop
                continue
            calls.append(call)
            i = end + 1
        return "".join(content), tuple(calls)

    def _parse_call(self, inner: list[int | str], string_args: dict[str, set[str]], call_id: str) -> ToolCall | None:
        """`name (<arg_key>k</arg_key><arg_value>v</arg_value>)*`, whitespace allowed between pairs."""
        if not inner or not isinstance(inner[0], str) or not inner[0].strip():
            return None
        name, cursor = inner[0].strip(), _Cursor(inner, 1)
        arguments: dict[str, Any] = {}
        try:
            while cursor.skip_whitespace():
                key = cursor.enclosed(self._id["<arg_key>"], self._id["</arg_key>"]).strip()
                cursor.skip_whitespace()
                value = cursor.enclosed(self._id["<arg_value>"], self._id["</arg_value>"])
                arguments[key] = value if key in string_args.get(name, ()) else _decode_value(value)
        except _Malformed:
            return None
        return ToolCall(name, arguments, call_id)


def appended_messages(
    previous: Sequence[Message],
    current: Sequence[Message],
    previous_tools: Sequence[Mapping] | None = None,
    current_tools: Sequence[Mapping] | None = None,
) -> list[Message] | None:
    """The messages `current` appends to `previous`, or None if it does not extend it.

    Messages compare as rendered: role (developer = system), text, stripped assistant content and
    tool calls by name and decoded arguments (ids ignored). An assistant message's reasoning is
    compared only when the new message carries `reasoning_content`, since most clients drop it.
    Different tools also mean no extension (tools are rendered at the start).
    """
    if _tools_key(previous_tools) != _tools_key(current_tools) or len(current) < len(previous):
        return None
    for index, (old, new) in enumerate(zip(previous, current)):
        reasoning_matters = isinstance(new, Mapping) and new.get("reasoning_content") is not None
        if _message_key(old, index, reasoning_matters) != _message_key(new, index, reasoning_matters):
            return None
    return list(current[len(previous) :])


# ---- message normalisation ---------------------------------------------------------------------


def _role(message: Message, index: int) -> str:
    role = message.get("role") if isinstance(message, Mapping) else None
    if role not in _ROLES:
        raise ChatTemplateError(f"messages[{index}]: role {role!r} is not one of {sorted(_ROLES)}")
    return _ROLES[role]


def _text(content: Any, index: int) -> str:
    """Content as text: a string, None, or a list of {"type": "text", "text": ...} parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")


def _tool_calls(message: Message, index: int) -> list[ToolCall]:
    calls = []
    for n, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"messages[{index}].tool_calls[{n}] needs function.name")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise ChatTemplateError(f"messages[{index}].tool_calls[{n}].function.arguments is not JSON: {e}")
        if not isinstance(arguments, Mapping):
            raise ChatTemplateError(f"messages[{index}].tool_calls[{n}].function.arguments must be a JSON object")
        calls.append(ToolCall(function["name"], dict(arguments), str(call.get("id") or "")))
    return calls


def _message_key(message: Message, index: int, with_reasoning: bool) -> tuple:
    role = _role(message, index)
    text = _text(message.get("content"), index)
    if role != "assistant":
        return role, text
    calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in _tool_calls(message, index))
    reasoning = (message.get("reasoning_content") or "").strip() if with_reasoning else None
    return role, text.strip(), calls, reasoning


def _function_spec(tool: Mapping, index: int) -> dict[str, Any]:
    """The function part of an OpenAI tool ({"type": "function", "function": {...}}), minus `strict`."""
    spec = tool.get("function") if isinstance(tool, Mapping) and "function" in tool else tool
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ChatTemplateError(f"tools[{index}] needs a function with a name")
    return {key: value for key, value in spec.items() if key != "strict"}


def _tools_key(tools: Sequence[Mapping] | None) -> str:
    return json.dumps([_function_spec(tool, i) for i, tool in enumerate(tools or [])], sort_keys=True)


def _string_arguments(tools: Sequence[Mapping] | None) -> dict[str, set[str]]:
    """Tool name -> names of the arguments its JSON schema types as string."""
    result = {}
    for i, tool in enumerate(tools or []):
        spec = _function_spec(tool, i)
        properties = (spec.get("parameters") or {}).get("properties") or {}
        result[spec["name"]] = {key for key, schema in properties.items() if _is_string_schema(schema)}
    return result


def _is_string_schema(schema: Any) -> bool:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _format_value(value: Any) -> str:
    """Strings raw, everything else as JSON (GLM's `v | tojson if v is not string else v`)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _decode_value(text: str) -> Any:
    """JSON value if `text` is JSON (NaN/Infinity are not), else the text itself."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return text


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _index(items: Sequence, item: Any, start: int) -> int | None:
    try:
        return items.index(item, start)
    except ValueError:
        return None


class _Malformed(Exception):
    pass


class _Cursor:
    """Walks the pieces of one tool call."""

    def __init__(self, pieces: list[int | str], position: int):
        self.pieces, self.position = pieces, position

    def skip_whitespace(self) -> bool:
        """Skip whitespace-only text; True while pieces remain."""
        while self.position < len(self.pieces):
            piece = self.pieces[self.position]
            if not isinstance(piece, str) or piece.strip():
                return True
            self.position += 1
        return False

    def enclosed(self, opener: int, closer: int) -> str:
        """The text of `opener text closer` at the cursor ("" if the text is empty)."""
        pieces, p = self.pieces, self.position
        if p >= len(pieces) or pieces[p] != opener:
            raise _Malformed
        has_text = p + 1 < len(pieces) and isinstance(pieces[p + 1], str)
        text = pieces[p + 1] if has_text else ""
        p += 2 if has_text else 1
        if p >= len(pieces) or pieces[p] != closer:
            raise _Malformed
        self.position = p + 1
        return text
