"""Hierarchical context management of the agent loop (GLM-5 §4.2.4): keep-recent-k and discard-all.

Long-horizon agents outgrow their context. Before each model call the AgentLoop hands the conversation
to its ContextPolicy, which may return an edited copy:

* keep-recent-k: "once the interaction exceeds k rounds, tool observations older than the last k rounds
  are folded into a placeholder" (k = 5 in the paper). A round is one assistant reply with tool calls and
  the observations answering it. `fold_every` > 1 folds in batches (only once that many rounds past the
  last k are unfolded), so the context changes once per `fold_every` rounds instead of every round.
* discard-all: "when the total context exceeds T tokens, the tool-call history is discarded and the
  agent continues from a fresh context" (T = 32k in the paper). What survives is not specified there;
  here it is the task (every message before the first assistant reply: system prompt and task prompt),
  a note saying that earlier rounds were discarded (the environment's state, e.g. edited files, persists:
  without the note the agent would believe it has done nothing), and the last `discard_keep_rounds`
  rounds (default 1: the latest action and what it returned, so the agent does not repeat it blindly).
* both: folding first, then discard-all on the folded context (the paper's best combination).
* a policy of one's own: any object with `edit(messages, view) -> list | None` (`ContextConfig.policy`).

An edit is what it looks like to the gateway: a message list that no longer extends the session's record,
so the gateway opens a new segment with a fresh render of the edited list and never re-tokenizes tokens
the model saw (docs/gateway.md). Each segment is a sample of the episode and shares its reward.

Token counts: the gateway's `usage` of the last call is exact. Messages added since then are bounded by
their UTF-8 size plus a per-message allowance for the template's tokens: a byte-level BPE tokenizer (GLM,
Qwen, Llama 3, DeepSeek) never makes more tokens than bytes. So discard-all acts before any call whose
prompt could pass T, not after one did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from asyncrl.plugins import load_object

MESSAGE_TOKEN_ALLOWANCE = 16
"""Template tokens one message may add beyond its JSON text (role markers, tool-response tags)."""


@dataclass(frozen=True)
class ContextConfig:
    """An env's context management (the env section's `context`, `--context-option k=v`); all off by default."""

    keep_recent_k: Optional[int] = None
    """Fold tool observations older than the last k rounds; None: never fold."""
    fold_every: int = 1
    """Fold once this many rounds are past the last k (1: every round, the paper's rule). Larger keeps a
    segment (and the engine's prefix cache) for more calls; the context then holds at most
    k + fold_every - 1 unfolded rounds."""
    placeholder: str = "[tool output folded: {chars} characters]"
    """What a folded observation says; `{chars}` is its length."""
    discard_at_tokens: Optional[int] = None
    """T: start from a fresh context before a call whose prompt could exceed T tokens; None: never."""
    discard_keep_rounds: int = 1
    """Most recent rounds kept through a discard (dropped too when they would not fit under T)."""
    discard_note: str = ("[Context reset: the {rounds} earlier rounds of tool calls and their results were "
                         "discarded to fit the context. Their effects on the environment remain; continue the task.]")
    """A user message after the task; `{rounds}` is how many rounds were discarded; "" adds none."""
    policy: Optional[str] = None
    """Import path of a policy of one's own (package.module:Class), applied after the built-in ones; it is
    built per episode with `policy_options` as keyword arguments."""
    policy_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keep_recent_k is not None and self.keep_recent_k < 0:
            raise ValueError(f"context.keep_recent_k must be >= 0, got {self.keep_recent_k}")
        if self.fold_every < 1:
            raise ValueError(f"context.fold_every must be >= 1, got {self.fold_every}")
        if self.discard_at_tokens is not None and self.discard_at_tokens < 1:
            raise ValueError(f"context.discard_at_tokens must be >= 1, got {self.discard_at_tokens}")
        if self.discard_keep_rounds < 0:
            raise ValueError(f"context.discard_keep_rounds must be >= 0, got {self.discard_keep_rounds}")


@dataclass
class ContextLog:
    """What context management did in one episode, and each model call's context (EpisodeResult.info
    "context", the service's /metrics)."""

    prompt_tokens: list[int] = field(default_factory=list)
    """Per model call, the prompt's length in tokens (the gateway's usage)."""
    cached_tokens: list[int] = field(default_factory=list)
    """Per model call, prompt tokens the engine served from its prefix cache."""
    folds: int = 0
    """Observations folded into a placeholder."""
    discards: int = 0
    """Fresh contexts started."""
    edits: int = 0
    """Calls whose context was edited (each opens a gateway segment)."""

    def summary(self) -> dict[str, Any]:
        """The episode's totals (per-call sizes go to the service's histogram, not into every sample)."""
        calls = len(self.prompt_tokens)
        return {"calls": calls, "folds": self.folds, "discards": self.discards, "edits": self.edits,
                "max_prompt_tokens": max(self.prompt_tokens, default=0),
                "mean_prompt_tokens": round(sum(self.prompt_tokens) / calls, 1) if calls else 0.0,
                "cached_tokens": sum(self.cached_tokens)}


@dataclass
class ContextView:
    """What a policy may read besides the messages: the last call's context size, and a bound of the next's."""

    last_context_tokens: Optional[int]
    """Prompt + completion tokens of the last call (exact, the gateway's usage); None before the first."""
    messages_at_last_call: int
    """How many of the messages the last call's context held (the rest were added since)."""
    log: ContextLog

    def bound_tokens(self, messages: list[dict[str, Any]]) -> int:
        """An upper bound of the tokens the next prompt of `messages` takes (see the module docstring)."""
        if self.last_context_tokens is None or self.messages_at_last_call > len(messages):
            return message_token_bound(messages) + MESSAGE_TOKEN_ALLOWANCE
        added = messages[self.messages_at_last_call:]
        return self.last_context_tokens + message_token_bound(added) + MESSAGE_TOKEN_ALLOWANCE


class ContextPolicy(Protocol):
    def edit(self, messages: list[dict[str, Any]], view: ContextView) -> Optional[list[dict[str, Any]]]:
        """The messages the next call should send, or None to send them unchanged. Never mutate `messages`."""


def message_token_bound(messages: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(m, ensure_ascii=False).encode()) + MESSAGE_TOKEN_ALLOWANCE for m in messages)


def rounds(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """[start, end) of each round: an assistant message with tool calls and the tool messages after it."""
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and message.get("tool_calls"):
            end = i + 1
            while end < len(messages) and messages[end].get("role") == "tool":
                end += 1
            spans.append((i, end))
    return spans


@dataclass(frozen=True)
class KeepRecent:
    """keep-recent-k: observations older than the last k rounds become a placeholder, in batches of
    `fold_every` rounds."""

    k: int
    fold_every: int = 1
    placeholder: str = ContextConfig.placeholder

    def edit(self, messages: list[dict[str, Any]], view: ContextView) -> Optional[list[dict[str, Any]]]:
        spans = rounds(messages)
        old = spans[:max(0, len(spans) - self.k)]
        unfolded = [span for span in old if not all(_folded(messages[i]) for i in range(span[0] + 1, span[1]))]
        if len(unfolded) < self.fold_every:
            return None
        edited = list(messages)
        for start, end in unfolded:
            for i in range(start + 1, end):
                if not _folded(messages[i]):
                    edited[i] = self.fold(messages[i])
                    view.log.folds += 1
        return edited

    def fold(self, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        chars = len(content) if isinstance(content, str) else len(json.dumps(content))
        return {**message, "content": self.placeholder.format(chars=chars), _MARK: "folded"}


_MARK = "_asyncrl_context"
"""Marks a message the policies wrote ("folded" observation, discard "note") inside the loop; dropped
before the messages go to the model (`for_model`)."""


def _folded(message: dict[str, Any]) -> bool:
    return message.get(_MARK) == "folded"


def for_model(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the model gets them: without the policies' marks."""
    return [{k: v for k, v in m.items() if k != _MARK} if _MARK in m else m for m in messages]


@dataclass(frozen=True)
class DiscardAll:
    """discard-all: before a call whose prompt could pass `max_tokens`, continue from the task, a note and
    the last `keep_rounds` rounds (fewer when they would not fit)."""

    max_tokens: int
    keep_rounds: int = 1
    note: str = ContextConfig.discard_note

    def edit(self, messages: list[dict[str, Any]], view: ContextView) -> Optional[list[dict[str, Any]]]:
        if view.bound_tokens(messages) <= self.max_tokens:
            return None
        spans = rounds(messages)
        if not spans:
            return None  # nothing but the task: there is no history to discard
        task = [m for m in messages[:spans[0][0]] if m.get(_MARK) != "note"]  # not an earlier discard's note
        for keep in range(min(self.keep_rounds, len(spans)), -1, -1):
            kept = spans[len(spans) - keep:] if keep else []
            note = [{"role": "user", "content": self.note.format(rounds=len(spans) - keep), _MARK: "note"}
                    ] if self.note else []
            fresh = task + note + (messages[kept[0][0]:] if kept else [])
            if keep == 0 or message_token_bound(fresh) + MESSAGE_TOKEN_ALLOWANCE <= self.max_tokens:
                break
        view.log.discards += 1
        return fresh


@dataclass(frozen=True)
class Policies:
    """Policies applied in order, each to the previous one's result."""

    policies: tuple[ContextPolicy, ...]

    def edit(self, messages: list[dict[str, Any]], view: ContextView) -> Optional[list[dict[str, Any]]]:
        current = messages
        for policy in self.policies:
            current = policy.edit(current, view) or current
        return None if current is messages else current


class ContextManager:
    """One episode's context management, for any agent loop: `before_call` lets the policy edit the
    conversation (in place: the loop keeps the edited history) and gives what the model is sent;
    `after_call` logs the call's context from the gateway's usage for the next decision."""

    def __init__(self, policy: Optional[ContextPolicy], log: ContextLog):
        self.policy, self.log = policy, log
        self.view = ContextView(last_context_tokens=None, messages_at_last_call=0, log=log)
        self.calls = 0

    def before_call(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.policy is not None and self.calls:  # the first call sends the task as it is
            edited = self.policy.edit(messages, self.view)
            if edited is not None:
                messages[:] = edited
                self.log.edits += 1
        return for_model(messages)

    def after_call(self, usage: Any, messages_in_context: int) -> None:
        """`usage`: the reply's (OpenAI) usage or None; `messages_in_context`: the messages sent + the reply."""
        self.calls += 1
        if usage is None:
            self.view.last_context_tokens = None
            return
        details = getattr(usage, "prompt_tokens_details", None)
        self.log.prompt_tokens.append(usage.prompt_tokens)
        self.log.cached_tokens.append(getattr(details, "cached_tokens", None) or 0)
        self.view.last_context_tokens, self.view.messages_at_last_call = usage.total_tokens, messages_in_context


def build_policy(config: ContextConfig) -> Optional[ContextPolicy]:
    """The episode's policy from the env's context config; None when context management is off."""
    policies: list[ContextPolicy] = []
    if config.keep_recent_k is not None:
        policies.append(KeepRecent(config.keep_recent_k, config.fold_every, config.placeholder))
    if config.discard_at_tokens is not None:
        policies.append(DiscardAll(config.discard_at_tokens, config.discard_keep_rounds, config.discard_note))
    if config.policy is not None:
        policies.append(load_object(config.policy)(**config.policy_options))
    if not policies:
        return None
    return policies[0] if len(policies) == 1 else Policies(tuple(policies))
