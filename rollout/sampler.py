"""Batched token sampling whose result for one request never depends on the rest of the batch.

Randomness is counter-based: the uniform number that picks request r's n-th token is
splitmix64(seed_r, n), computed for the whole batch in one vectorised numpy call. A request with a
`sampling_seed` therefore reproduces its tokens under any concurrent load, retraction or restart,
and no per-request generator objects are needed.

Log-probs (what RL trains against) are those of the distribution the token was drawn from before
any truncation: log_softmax(logits / temperature), temperature 1 for greedy requests. top-k, top-p
and min-p only restrict which tokens can be drawn; they do not renormalise the reported log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """uint64 hash of each (seed, counter) pair (SplitMix64's output function); a pure function."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + (counters.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def splitmix64_uniform(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) doubles, one per (seed, counter) pair; a pure function of its inputs."""
    return (splitmix64(seeds, counters) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one decode step (rows = requests)."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, <= 0 = disabled
    min_p: torch.Tensor  # [B] float32
    seeds: np.ndarray  # [B] uint64
    counters: np.ndarray  # [B] uint64: tokens this request has sampled so far

    def shifted(self, offset: int) -> "SamplingBatch":
        """The same rows sampling the token `offset` places after their next one (a draft or a verified
        position of speculative decoding)."""
        return replace(self, counters=self.counters + np.uint64(offset))

    @property
    def needs_filtering(self) -> bool:
        return bool((self.top_p < 1.0).any() or (self.top_k > 0).any() or (self.min_p > 0).any())


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: log-prob of the chosen token
    logprob_rows: torch.Tensor  # [B, V] float32: full log-softmax (for top_logprobs)


def drawable_probs(logits: torch.Tensor, batch: SamplingBatch, banned: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (log_softmax(logits / temperature): the reported log-probs, temperature 1 for
    greedy rows; the unnormalised weights a token is drawn with: their exp with the tokens top-k / top-p /
    min-p exclude and `banned` ones zeroed). `sample` draws from them; speculative acceptance compares them."""
    greedy = batch.temperature <= 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    logprob_rows = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)  # [B, V]
    probs = logprob_rows.exp()
    if batch.needs_filtering:
        probs = _filter(probs, batch)
    if banned is not None:
        probs = probs.masked_fill(banned, 0.0)
    return logprob_rows, probs


def sample(logits: torch.Tensor, batch: SamplingBatch, banned: Optional[torch.Tensor] = None) -> SampleOutput:
    """logits [B, V] (fp32) -> one token per row. `banned` [B, V] bool: tokens that may not be drawn
    (stop tokens before min_new_tokens); they keep their share of the reported log-probs."""
    greedy = batch.temperature <= 0
    logprob_rows, probs = drawable_probs(logits, batch, banned)
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    tokens = draw(probs, torch.from_numpy(splitmix64_uniform(batch.seeds, batch.counters)))
    if bool(greedy.any()):  # max().indices: the first maximum, as argmax, and ~3x faster on CPU
        tokens = torch.where(greedy, logits.max(dim=-1).indices, tokens)
    return SampleOutput(tokens, logprob_rows.gather(-1, tokens[:, None]).squeeze(-1), logprob_rows)


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row of `weights` [B, V] (unnormalised, >= 0), by inverting its CDF at `uniform` [B]."""
    cdf = weights.cumsum(dim=-1)  # [B, V]
    targets = (uniform.to(weights.dtype) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def _filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero the probabilities top-k / top-p / min-p exclude (no renormalisation: the CDF walk scales)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(probs.shape[-1]).expand_as(sorted_probs)
    top_k = torch.where(batch.top_k > 0, batch.top_k, probs.shape[-1])
    keep = ranks < top_k[:, None]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < batch.top_p[:, None]
    keep &= sorted_probs >= batch.min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    filtered = torch.zeros_like(probs)
    return filtered.scatter_(-1, order, sorted_probs * keep)
