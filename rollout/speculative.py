"""Speculative decoding's draft and acceptance rules: rejection sampling that keeps every emitted token
distributed exactly as the target would sample it, for every sampling setting `sample` supports
(Leviathan et al. 2023, Chen et al. 2023; SGLang's tree_speculative_sampling_target_only for chains).

Per request, drafts d_1..d_k were drawn from the draft distributions q_1..q_k (the MTP layer's logits
under the request's own temperature, filters and bans: `draft`); the target's one forward over
[x, d_1..d_k] gives p_1..p_{k+1}, each what `sample` would draw from there. Walking i = 1..k: accept d_i
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token drawn from
max(0, p_i - q_i) (normalised) and stop; when all k are accepted emit a bonus token drawn from p_{k+1}.
Each emitted token is then distributed as p given the tokens before it (`verify`).

Greedy requests (temperature 0): p and q are one-hot on their first maximum, so a draft is accepted iff
it is the target's greedy token, and the emitted correction is that token: exactly greedy decoding.

Randomness is counter-based, as the sampler's: output token n of a request draws from uniforms of
(seed, use, n), one stream per use (drafting, accepting, correcting), so a seeded request reproduces
under any load and its drafts do not consume the acceptance's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from rollout.sampler import SamplingBatch, draw, drawable_probs, splitmix64, splitmix64_uniform

DRAFT, ACCEPT, CORRECT = np.uint64(1), np.uint64(2), np.uint64(3)
"""Stream ids: the uniforms of use u for a request come from seed splitmix64(seed, u)."""


@dataclass
class Verdict:
    accepted: torch.Tensor
    """[B] int64: drafts accepted (0..k)."""
    tokens: torch.Tensor
    """[B, k + 1] int64: per row the accepted drafts, then the correction or bonus token at index
    `accepted`; entries after it are 0 and not emitted."""
    logprobs: torch.Tensor
    """[B, k + 1] float32: the reported log-prob of each entry of `tokens` (as `sample` reports it)."""
    logprob_rows: torch.Tensor
    """[B, k + 1, V] log_softmax(target logits / temperature) of each position (temperature 1 for greedy
    rows), for top_logprobs."""


def distribution(logits: torch.Tensor, batch: SamplingBatch, banned: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, V] normalised probabilities of the token `sample` draws from `logits`: one-hot on the first
    maximum of the unbanned logits for greedy rows."""
    return _target(logits, batch, banned)[1]


def _target(logits: torch.Tensor, batch: SamplingBatch, banned: Optional[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the reported log-prob rows, the normalised distribution a token is drawn from)."""
    logprob_rows, weights = drawable_probs(logits, batch, banned)
    probs = weights / weights.sum(-1, keepdim=True)
    greedy = batch.temperature <= 0
    if bool(greedy.any()):
        masked = logits if banned is None else logits.masked_fill(banned, float("-inf"))
        one_hot = torch.zeros_like(probs).scatter_(1, masked.max(dim=-1).indices[:, None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return logprob_rows, probs


def draft(logits: torch.Tensor, batch: SamplingBatch, banned: Optional[torch.Tensor] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft token per row from draft logits [B, V] (batch.counters: the output index it drafts)
    -> (tokens [B], q [B, V]: the distribution they were drawn from, which `verify` needs)."""
    q = distribution(logits, batch, banned)
    return draw(q, _uniform(batch, DRAFT)), q


def verify(target_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor, batch: SamplingBatch,
           banned: Optional[torch.Tensor] = None) -> Verdict:
    """target_logits [B, k + 1, V] (position i scores output n + i, n = batch.counters), drafts [B, k],
    draft_probs [B, k, V] (q of each draft), banned [B, k + 1, V] or None -> the emitted tokens.

    All positions at once: p of every position, one acceptance uniform per draft and one correction draw
    per position (the one after the last accepted draft is emitted; drawing the others too costs less
    than a loop over positions, and the counter-based numbers make each position's draw its own)."""
    rows, width, vocab = target_logits.shape
    k = width - 1
    at = _per_position(batch, width)
    logprob_rows, p = _target(target_logits.reshape(rows * width, vocab).float(), at,
                              None if banned is None else banned.reshape(rows * width, vocab))
    logprob_rows, p = logprob_rows.view(rows, width, vocab), p.view(rows, width, vocab)
    u = _uniform(at, ACCEPT).view(rows, width)[:, :k].to(p.dtype)
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    accepted = torch.cumprod((u * q_d < p_d).long(), dim=1).sum(1)  # the first rejection ends the walk
    residual = (p[:, :k] - draft_probs).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, :k])
    residual = torch.cat([residual, p[:, k:]], 1)  # every draft accepted: the bonus comes from p
    emitted = draw(residual.view(rows * width, vocab), _uniform(at, CORRECT)).view(rows, width)
    column = torch.arange(width)[None, :]
    tokens = torch.where(column < accepted[:, None], torch.cat([drafts, drafts[:, :1]], 1),
                         torch.where(column == accepted[:, None], emitted, 0))
    return Verdict(accepted, tokens, logprob_rows.gather(-1, tokens[..., None]).squeeze(-1), logprob_rows)


def _per_position(batch: SamplingBatch, width: int) -> SamplingBatch:
    """Row r of `batch` repeated for positions 0..width-1 (row r * width + i: output counters[r] + i)."""
    def repeat(values: torch.Tensor) -> torch.Tensor:
        return values.repeat_interleave(width)
    counters = (batch.counters[:, None] + np.arange(width, dtype=np.uint64)[None, :]).reshape(-1)
    return SamplingBatch(repeat(batch.temperature), repeat(batch.top_p), repeat(batch.top_k), repeat(batch.min_p),
                         np.repeat(batch.seeds, width), counters)


def _uniform(batch: SamplingBatch, stream: np.uint64) -> torch.Tensor:
    seeds = splitmix64(batch.seeds, np.full_like(batch.seeds, stream))
    return torch.from_numpy(splitmix64_uniform(seeds, batch.counters))
