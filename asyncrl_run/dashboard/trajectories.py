"""The trajectory browser: the run's recorded samples (the `samples` stream), paged newest first and
filtered, and one sample opened: its turns, tool calls and tokens.

A sample's turns are its loss-mask runs: each run of 1s is a model turn (decoded, its tool calls parsed
with the run's chat template), each run of 0s the prompt or the observations (tool results, user
messages) between turns. Every token comes with its loss mask, the rollout's log-prob and weight version,
and once the trainer has trained the sample (its `trained` record, docs/store.md) the trainer's log-prob
and whether the trust (IS) band kept it or masked it.

The tokenizer is the run's: `tokenizer` (and `thinking`) of <run_dir>/config/gateway.json, the gateway's
resolved section, which holds the run's model.tokenizer; `builtin:tiny` when the run dir has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import numpy as np

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.store import Store
from asyncrl.tokenizer import BUILTIN_TINY, Tokenizer, load_tokenizer
from asyncrl.types import Sample, TrainedTokens

PAGE_MAX = 200
SCAN_MAX = 10_000
SCAN_PAGE = 200


@dataclass(frozen=True)
class SampleFilter:
    """What the list shows: each field None matches every sample. `outcome` matches the sample's status
    (completed, failed, truncated, aborted), its outcome class (model, environment, infrastructure) or its
    reason (max_turns, deadline_exceeded, ...); `step` is the trainer step that trained it."""

    env: Optional[str] = None
    min_reward: Optional[float] = None
    max_reward: Optional[float] = None
    step: Optional[int] = None
    outcome: Optional[str] = None

    def matches(self, sample: Sample, trained: Optional[TrainedTokens]) -> bool:
        if self.env is not None and sample.env != self.env:
            return False
        if self.min_reward is not None and sample.reward < self.min_reward:
            return False
        if self.max_reward is not None and sample.reward > self.max_reward:
            return False
        if self.step is not None and (trained is None or trained.step != self.step):
            return False
        return self.outcome is None or self.outcome in (sample.status, sample.outcome_class, sample.outcome_reason)


def summary(ref: str, sample: Sample, trained: Optional[TrainedTokens]) -> dict[str, Any]:
    """A sample's row in the list."""
    generated = sample.weight_versions[sample.loss_mask.astype(bool)]
    return {
        "ref": ref, "sample_id": sample.sample_id, "session_id": sample.session_id, "group_id": sample.group_id,
        "task_id": sample.task_id, "env": sample.env, "status": sample.status, "reward": sample.reward,
        "outcome": sample.outcome_class, "reason": sample.outcome_reason, "num_turns": sample.num_turns,
        "num_tokens": sample.num_tokens, "loss_tokens": int(sample.loss_mask.sum()),
        "weight_versions": [int(generated.min()), int(generated.max())] if generated.size else [],
        "trained_step": trained.step if trained is not None else None,
        "kept_tokens": int(trained.kept.sum()) if trained is not None else None,
    }


async def page(store: Store, wanted: SampleFilter, before: str, count: int, scan: int) -> dict[str, Any]:
    """Up to `count` matching samples recorded before stream id `before` ("+": the newest), newest first,
    looking at `scan` samples at most; `next` is where the next page starts (None: the stream's start)."""
    if before == "0-0":  # nothing is recorded before the first possible id
        return {"samples": [], "next": None, "scanned": 0}
    rows: list[dict[str, Any]] = []
    scanned, cursor = 0, before
    while len(rows) < count and scanned < scan:
        asked = min(SCAN_PAGE, scan - scanned)
        entries = await store.list_samples(before=cursor, count=asked)
        trained = await store.trained([ref for ref, _ in entries])
        for i, (ref, sample) in enumerate(entries):
            scanned, cursor = scanned + 1, ref
            if wanted.matches(sample, trained.get(ref)):
                rows.append(summary(ref, sample, trained.get(ref)))
                if len(rows) == count:
                    exhausted = len(entries) < asked and i == len(entries) - 1
                    return {"samples": rows, "next": None if exhausted else cursor, "scanned": scanned}
        if len(entries) < asked:  # the stream's first sample was in this page
            return {"samples": rows, "next": None, "scanned": scanned}
    return {"samples": rows, "next": cursor, "scanned": scanned}


class TrajectoryView:
    """Opens samples with the run's tokenizer and chat template."""

    def __init__(self, run_dir: Optional[Path], tokenizer: Optional[str] = None) -> None:
        self.spec, self.thinking = _run_tokenizer(run_dir)
        self.spec = tokenizer or self.spec

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.spec)

    @cached_property
    def templates(self) -> Optional[dict[bool, GlmChatTemplate]]:
        """The chat template with thinking on and off (None: a tokenizer without GLM's special tokens; turns
        are shown, tool calls not parsed)."""
        try:
            return {thinking: GlmChatTemplate(self.tokenizer, thinking=thinking) for thinking in (True, False)}
        except ValueError:
            return None

    def _template_for(self, previous: Optional[int]) -> GlmChatTemplate:
        """A model turn opened by the generation prompt `<|assistant|><think>` is in a think block, one opened
        by `<|assistant|></think>` is not: the token before the turn says which, else the run's setting."""
        think = self.templates[True]
        if previous is not None and previous == think.tokenizer.token_id("<think>"):
            return think
        if previous is not None and previous == think.tokenizer.token_id("</think>"):
            return self.templates[False]
        return self.templates[self.thinking]

    def detail(self, ref: str, sample: Sample, trained: Optional[TrainedTokens]) -> dict[str, Any]:
        """The sample's turns and tokens (per-token arrays aligned with its tokens)."""
        tokens = sample.tokens.tolist()
        mask = sample.loss_mask
        out = {**summary(ref, sample, trained), "metadata": _jsonable(sample.metadata),
               "timings": sample.timings, "engines": sample.engines, "tokenizer": self.spec,
               "turns": [self._turn(kind, start, end, tokens) for kind, start, end in spans(mask)],
               "tokens": {"ids": tokens, "text": [self._piece(t) for t in tokens], "loss_mask": mask.tolist(),
                          "rollout_logprobs": _floats(sample.rollout_logprobs),
                          "weight_versions": sample.weight_versions.tolist()}}
        if trained is not None:
            band_masked = int(((mask == 1) & (trained.kept[: len(mask)] == 0)).sum())
            out["trained"] = {"step": trained.step, "weight_version": trained.weight_version,
                              "kept_tokens": int(trained.kept.sum()), "band_masked_tokens": band_masked}
            out["tokens"].update({"trainer_logprobs": _floats(trained.trainer_logprobs),
                                  "kept": trained.kept.tolist()})
        return out

    def _turn(self, kind: str, start: int, end: int, tokens: list[int]) -> dict[str, Any]:
        ids = tokens[start:end]
        turn: dict[str, Any] = {"kind": kind, "start": start, "end": end, "text": self.tokenizer.decode(ids)}
        if kind == "model" and self.templates is not None:
            message = self._template_for(tokens[start - 1] if start else None).parse_assistant(ids)
            turn.update(content=message.content, reasoning=message.reasoning_content,
                        tool_calls=[{"name": c.name, "arguments": c.arguments} for c in message.tool_calls])
        return turn

    def _piece(self, token_id: int) -> str:
        try:
            return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
        except Exception:  # an id outside the vocabulary (the wrong tokenizer): shown as its id
            return f"<{token_id}>"


def spans(mask: np.ndarray) -> list[tuple[str, int, int]]:
    """(kind, start, end) of each run of equal loss-mask values: `model` for 1s, `context` for 0s."""
    if len(mask) == 0:
        return []
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(mask)]
    return [("model" if mask[a] else "context", a, b) for a, b in zip(bounds, bounds[1:])]


def _run_tokenizer(run_dir: Optional[Path]) -> tuple[str, bool]:
    path = run_dir / "config" / "gateway.json" if run_dir is not None else None
    try:
        section = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        section = {}
    return section.get("tokenizer") or BUILTIN_TINY, bool(section.get("thinking", True))


def _floats(values: np.ndarray) -> list[Optional[float]]:
    """Rounded for the page; NaN/inf (never expected) as None, which JSON can carry."""
    return [round(v, 5) if np.isfinite(v) else None for v in values.astype(float).tolist()]


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))
