"""Reading /generate answers on the client side: stream events into cumulative snapshots, and
`meta_info.routed_experts` into an array (docs/engine.md)."""

from __future__ import annotations

import base64
from typing import Any, Optional

import numpy as np

from asyncrl.protocols.engine import GenerateResponse, MetaInfo, WeightVersionSpan


class StreamAccumulator:
    """Cumulative snapshots from /generate stream events of either SGLang mode. A cumulative event
    (the default) carries all output so far: it replaces the snapshot. An incremental one
    (--incremental-streaming-output) carries fewer output_ids than meta_info.completion_tokens: its ids,
    text, output log-prob entries and weight-version spans extend the snapshot. Only the event itself is
    validated, so reading an incremental stream costs O(new tokens) per event plus list copies."""

    def __init__(self) -> None:
        self.snapshot: Optional[GenerateResponse] = None

    def add(self, event: dict[str, Any]) -> GenerateResponse:
        """-> the snapshot after `event` (a new object: earlier snapshots stay as they were)."""
        part = GenerateResponse.model_validate(event)
        if self.snapshot is None or len(part.output_ids) == part.meta_info.completion_tokens:
            self.snapshot = part
            return part
        done, meta = self.snapshot, part.meta_info
        if len(done.output_ids) + len(part.output_ids) != meta.completion_tokens:
            raise ValueError(f"stream event of {len(part.output_ids)} new tokens after {len(done.output_ids)} does "
                             f"not add up to completion_tokens {meta.completion_tokens}")
        update: dict[str, Any] = {"weight_versions": _join_spans(done.meta_info.weight_versions, meta.weight_versions)}
        for key in ("output_token_logprobs", "output_top_logprobs"):
            earlier, new = getattr(done.meta_info, key), getattr(meta, key)
            if earlier is not None or new is not None:
                update[key] = (earlier or []) + (new or [])
        self.snapshot = GenerateResponse.model_construct(
            text=(done.text or "") + (part.text or ""), output_ids=done.output_ids + part.output_ids,
            meta_info=meta.model_copy(update=update))
        return self.snapshot


def _join_spans(spans: list[WeightVersionSpan], new: list[WeightVersionSpan]) -> list[WeightVersionSpan]:
    """Spans of the tokens so far followed by those of the next tokens, merging a version that continues."""
    if spans and new and spans[-1].version == new[0].version and spans[-1].end == new[0].start:
        return [*spans[:-1], spans[-1].model_copy(update={"end": new[0].end}), *new[1:]]
    return [*spans, *new]


def routed_experts(meta: MetaInfo, num_tokens: int) -> np.ndarray:
    """SGLang's meta_info.routed_experts -> int32 [num_tokens, layers x top_k] (reshape to [.., layers, top_k]
    with the model's sizes): the experts each MoE layer sent token t of prompt + output to, for the tokens
    that went through a forward (a finished request: all but the last output token). This engine writes -1
    on dense layers; SGLang leaves whatever its buffer holds there."""
    if meta.routed_experts is None:
        raise ValueError("the response has no routed_experts: ask with return_routed_experts=True")
    flat = np.frombuffer(base64.b64decode(meta.routed_experts), dtype=np.int32)
    if num_tokens <= 0 or flat.size % num_tokens:
        raise ValueError(f"routed_experts holds {flat.size} expert ids: not a row per token for {num_tokens} tokens")
    return flat.reshape(num_tokens, -1)
