"""One generation request inside the engine: its tokens, KV slots, sampling state and stop rules.

Token layout: `all_ids = prompt + output`. The first `num_computed` of them have their KV in the pool
(`slots[:num_computed]`); the rest are pending (the prompt before prefill, or the one token sampled
last step). `num_prefix_slots` leading slots belong to the radix cache (locked via `prefix_node`),
the others to this request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from asyncrl.protocols.engine import GenerateItem


@dataclass(eq=False)
class Req:
    item: GenerateItem
    prompt: list[int]
    seed: int
    stop_ids: frozenset[int]
    """EOS ids (unless ignore_eos) plus the request's stop_token_ids."""
    on_update: Callable[["Req"], None]
    """Called from the engine thread after each step that changed the request, and at finish."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    input_logprobs: list[Optional[float]] = field(default_factory=list)
    input_top_logprobs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    slots: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    num_computed: int = 0
    num_prefix_slots: int = 0
    prefix_node: Any = None
    cached_tokens: int = 0
    mtp_done: int = 0
    """Speculative decoding: MTP positions [0, mtp_done) have their KV rows (rollout/drafting.py)."""
    spec_verify_ct: int = 0
    """Speculative decoding: verification forwards so far (SGLang's meta_info field)."""
    kv_generation: int = 0
    """Cache generation (bumped by weight updates with flush) its KV was computed under."""
    routed_experts: Optional[torch.Tensor] = None
    """int32 [tokens, layers, top_k] of the computed tokens (all but the last), set at finish if asked."""
    finish_reason: Optional[dict[str, Any]] = None
    matched_stop_text: Optional[str] = None
    created: float = field(default_factory=time.monotonic)
    row: int = -1
    """Row in the engine's request -> slot table while running."""

    @property
    def rid(self) -> str:
        return self.item.rid

    @property
    def all_len(self) -> int:
        return len(self.prompt) + len(self.output_ids)

    def pending_ids(self, count: int) -> list[int]:
        """The next `count` tokens whose KV is not computed yet."""
        return self.token_slice(self.num_computed, self.num_computed + count)

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """Tokens [lo, hi) of prompt + output, without copying the whole sequence."""
        n = len(self.prompt)
        if lo >= n:
            return self.output_ids[lo - n:hi - n]
        return self.prompt[lo:hi] + self.output_ids[:max(hi - n, 0)]

    def computed_ids(self) -> list[int]:
        return self.token_slice(0, self.num_computed)

    @property
    def pending(self) -> int:
        return self.all_len - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.item.return_logprob and self.item.logprob_start_len >= 0

    def append_token(self, token: int, logprob: float, version: str,
                     top: Optional[list[tuple[float, int]]]) -> None:
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        if top is not None:
            self.output_top_logprobs.append(top)
        self._check_stop(token)

    def _check_stop(self, token: int) -> None:
        params = self.item.sampling
        n = len(self.output_ids)
        if n >= params.min_new_tokens and token in self.stop_ids:
            self.finish_reason = {"type": "stop", "matched": token}
        elif n >= params.max_new_tokens:
            self.finish_reason = {"type": "length", "length": n}

    def check_stop_strings(self, decode: Callable[[list[int]], str]) -> None:
        """Stop strings are matched on the decoded tail of the output (a stop string spans at most
        a few tokens, so only the last window is decoded)."""
        stops = self.item.sampling.stop
        if not stops or self.finished or len(self.output_ids) < self.item.sampling.min_new_tokens:
            return
        window = max(len(s) for s in stops) + 8
        tail = decode(self.output_ids[-window:])
        for stop in stops:
            if stop in tail:
                self.finish_reason = {"type": "stop", "matched": stop}
                self.matched_stop_text = stop
                return

    def abort(self, message: str) -> None:
        if not self.finished:
            self.finish_reason = {"type": "abort", "message": message}

