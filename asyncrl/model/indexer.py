"""DSA lightning indexer: picks the k context tokens each query attends to (REFERENCE.md).

    qi = wq_b(q_resid) -> [Hi, D], each head [rope | pass]      ki = LayerNorm(wk(x)) -> [D], rope on first part
    w  = weights_proj(x) * Hi^-0.5 (fp32)
    I[t, s] = sum_h w[t, h] * ReLU(qi[t, h] . ki[s] * D^-0.5)   for s <= t
    selected(t) = top-k of I[t, :], k = min(index_topk, t + 1)

Tie-break (RL needs it deterministic): among equal scores the lower position wins. It is built into the
top-k key itself (score bits in the high 32 bits, inverted position in the low 32), so every key is
unique and the selected set depends only on the scores of the causal keys: not on row length (padding),
batch composition, chunking or cache state. -0.0 and +0.0 count as equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model.batch import ForwardBatch
from asyncrl.model.config import ModelConfig
from asyncrl.model.rope import apply_rope


@dataclass
class Selection:
    """The keys each query attends to: context positions (padded layout) and slots (flat layout)."""

    index: torch.Tensor
    """[B, Lq, k] int64 context positions (in no particular order)."""
    valid: torch.Tensor
    """[B, Lq, k] bool: False where the query has fewer than k causal keys."""
    slots: torch.Tensor
    """[N, k] slot ids per flat query: the rows the sparse attention gathers."""
    invalid: torch.Tensor
    """[N, k] bool: ~valid per flat query."""

    @classmethod
    def of(cls, index: torch.Tensor, batch: ForwardBatch) -> "Selection":
        num_seqs, max_extend, k = index.shape
        valid = index <= batch.query_positions[..., None]
        slots = batch.context_slots.gather(1, index.reshape(num_seqs, -1)).view(num_seqs, max_extend, k)
        return cls(index, valid, batch.to_flat(slots), ~batch.to_flat(valid))

    def dense_mask(self, context_width: int) -> torch.Tensor:
        """[B, Lq, Lk] bool: True at selected keys (the dense reference path's mask)."""
        mask = torch.zeros(*self.index.shape[:2], context_width, dtype=torch.bool, device=self.index.device)
        return mask.scatter_(2, self.index, self.valid)


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.index_topk = config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim**-0.5

    def keys(self, x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> index keys [N, D] (what the cache stores per token)."""
        k = self.k_norm(self.wk(x))
        return torch.cat([apply_rope(k[:, : self.rope_dim], rotations), k[:, self.rope_dim :]], dim=-1)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, rotations: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> index queries [N, Hi, D] and fp32 head weights [N, Hi]."""
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim)  # [N, Hi, D]
        q = torch.cat([apply_rope(q[..., : self.rope_dim], rotations[:, None]), q[..., self.rope_dim :]], dim=-1)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        return q, weights

    @torch.no_grad()
    def select(self, q: torch.Tensor, weights: torch.Tensor, key_store: torch.Tensor, batch: ForwardBatch) -> Selection:
        """Top-k context positions per query. q [N, Hi, D], weights [N, Hi], key_store [slots, D]."""
        num_seqs, max_extend = batch.query_positions.shape
        k = min(self.index_topk, batch.max_context)
        first = batch.first_ranked_row(k)  # rows before it select all their causal keys: nothing to rank
        picked = [torch.arange(k, device=q.device).expand(num_seqs, first, k)] if first else []
        for start, end, scores in self._score_chunks(q, weights, key_store, batch, first):
            picked.append(rank_topk(scores, batch.noncausal[:, start:end], batch.position_tiebreak, k))
        return Selection.of(picked[0] if len(picked) == 1 else torch.cat(picked, dim=1), batch)  # [B, Lq, k]

    @torch.no_grad()
    def selection_margins(self, q: torch.Tensor, weights: torch.Tensor, key_store: torch.Tensor,
                          batch: ForwardBatch) -> torch.Tensor:
        """How far each query is from a near tie: (s_k - s_k+1) / |s_k| for its k-th and (k+1)-th largest
        causal index scores, as `select` ranks them -> [B, Lq] fp32 (inf where a query has at most k keys).
        A margin below fp32 rounding (~1e-7) lets two kernel paths select different keys (docs/model.md)."""
        k = self.index_topk
        margins = torch.full(batch.query_positions.shape, float("inf"))
        if batch.max_context <= k:
            return margins
        for start, end, scores in self._score_chunks(q, weights, key_store, batch, 0):
            top = scores.masked_fill_(batch.noncausal[:, start:end], float("-inf")).topk(k + 1, dim=-1).values
            margin = (top[..., k - 1] - top[..., k]) / top[..., k - 1].abs()
            margins[:, start:end] = torch.where(torch.isfinite(top[..., k]), margin, float("inf"))
        return margins

    def _score_chunks(self, q: torch.Tensor, weights: torch.Tensor, key_store: torch.Tensor, batch: ForwardBatch,
                      first: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Index scores [B, rows, Lk] of padded query rows first.. in chunks that bound the [B, rows, Hi, Lk]
        buffer by batch.max_score_elements. -> (start, end, scores) per chunk."""
        keys = gather_rows(key_store, batch.context_slots).float()  # [B, Lk, D]
        q_pad, w_pad = batch.to_padded(q).float(), batch.to_padded(weights)  # [B, Lq, Hi, D], [B, Lq, Hi]
        num_seqs, max_extend = batch.query_positions.shape
        rows = max(1, batch.max_score_elements // (num_seqs * self.n_heads * batch.max_context))
        for start in range(first, max_extend, rows):
            end = min(start + rows, max_extend)
            yield start, end, index_scores(q_pad[:, start:end], w_pad[:, start:end], keys, self.softmax_scale)

    def selected_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Differentiable index scores of gathered keys: q [N, Hi, D], weights [N, Hi], keys [N, k, D] -> [N, k]."""
        scores = F.relu(torch.bmm(q.float(), keys.float().transpose(1, 2)) * self.softmax_scale)  # [N, Hi, k]
        return torch.bmm(weights[:, None], scores).squeeze(1)


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table [slots, C], index [...] -> [..., C] (index_select: several times faster than table[index] on CPU)."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, table.shape[-1])


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """I = sum_h w_h ReLU(q_h . k * scale): q [B, Lq, Hi, D], weights [B, Lq, Hi], keys [B, Lk, D] -> [B, Lq, Lk].

    Not differentiable (in-place ops keep one [B, Lq, Hi, Lk] buffer); see Indexer.selected_scores."""
    num_seqs, max_extend, n_heads, _ = q.shape
    scores = torch.bmm(q.reshape(num_seqs, max_extend * n_heads, -1), keys.transpose(1, 2))  # [B, Lq * Hi, Lk]
    scores = scores.view(num_seqs, max_extend, n_heads, -1).mul_(scale).relu_()  # in place: one buffer
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def topk_lower_position_wins(scores: torch.Tensor, query_positions: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k key positions of scores [..., Lk] among causal keys (position <= query position) -> [..., k]."""
    key_pos = torch.arange(scores.shape[-1], device=scores.device)
    return rank_topk(scores.clone(), key_pos > query_positions[..., None], 0x7FFFFFFF - key_pos, k)


def rank_topk(scores: torch.Tensor, noncausal: torch.Tensor, tiebreak: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of scores [..., Lk] (overwritten) outside `noncausal`, ranked by (score, tiebreak) packed
    into one int64: no two keys tie, so the selected set is unique. -> positions [..., k] (unordered)."""
    scores = scores.float().add_(0.0).masked_fill_(noncausal, float("-inf"))  # fp32 even under bf16 autocast; -0.0 -> +0.0
    bits = scores.view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order == float order
    return ((ordered.to(torch.int64) << 32) | tiebreak).topk(k, dim=-1, sorted=False).indices
