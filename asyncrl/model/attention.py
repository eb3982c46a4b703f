"""Multi-head latent attention (MLA) with DeepSeek sparse attention (DSA), in absorbed form.

Per token only the latent row [c | k_pe] (kv_lora_rank + qk_rope_head_dim values, 576 for GLM-5.1)
is stored; kv_b_proj is never applied to the keys. Instead it is absorbed into the query and the output:

    k_nope[s, h] = W_kc[h] c[s]      =>  q_nope[h] . k_nope[s, h] = (W_kc[h]^T q_nope[h]) . c[s]
    v[s, h]      = W_vc[h] c[s]      =>  sum_s p[h, s] v[s, h]   = W_vc[h] (sum_s p[h, s] c[s])

so training, prefill and decode all attend over the same latent rows (from the KV cache, or the batch's
own fresh latents when there is no cache). Two interchangeable kernels:
  sparse: gather only the k selected latent rows per query, O(T * k) time and memory;
  dense:  all context rows with a (causal & selected) mask, O(T^2): the reference, and the faster one
          on CPU for short multi-query contexts (ForwardBatch.attention_impl says which runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch
from torch import nn

from asyncrl.model.batch import ForwardBatch
from asyncrl.model.config import ModelConfig
from asyncrl.model.indexer import Indexer, Selection, gather_rows
from asyncrl.model.kv_cache import KVCache
from asyncrl.model.norm import RMSNorm
from asyncrl.model.rope import apply_rope, softmax_scale


@dataclass(frozen=True)
class AttentionContext:
    """Per-forward inputs every layer reads (read-only, so checkpointed layers can be re-run)."""

    batch: ForwardBatch
    rotations: torch.Tensor
    """[N, rope_dim / 2] complex RoPE rotations of the new tokens."""
    cache: Optional[KVCache] = None
    indexer_kl: bool = False
    """Full-indexer layers also return the DeepSeek-V3.2 indexer alignment loss."""

    def needs_selection(self, index_topk: int) -> bool:
        impl = self.batch.attention_impl
        return impl == "sparse" or self.batch.max_context > index_topk or self.indexer_kl

    @cached_property
    def groups(self) -> list["AttentionGroup"]:
        """The batch's length groups (ForwardBatch.length_groups), each with its own context; built once
        per forward and shared by every layer. One group: the whole batch, no row shuffling."""
        seqs = self.batch.length_groups()
        if len(seqs) == 1:
            return [AttentionGroup(None, self)]
        groups = []
        for members in seqs:
            rows, sub = self.batch.subset(members, slots_are_rows=self.cache is None)
            groups.append(AttentionGroup(rows, AttentionContext(sub, self.rotations.index_select(0, rows), self.cache,
                                                                self.indexer_kl)))
        return groups

    @cached_property
    def ungroup(self) -> torch.Tensor:
        """[N]: where each row of the batch lies in the concatenation of the groups' rows."""
        order = torch.cat([g.rows for g in self.groups])
        return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


@dataclass(frozen=True)
class AttentionGroup:
    rows: Optional[torch.Tensor]
    """[n] rows of the batch this group attends for (None: all of them, in order)."""
    ctx: AttentionContext


Selections = list[Optional[Selection]]
"""One selection per length group of the context (AttentionContext.groups); None: every causal key."""


@dataclass
class AttentionOutput:
    out: torch.Tensor
    """[N, hidden]"""
    selection: Selections
    """This layer's selections (a full layer's own, or the ones it reused)."""
    indexer_kl: Optional[torch.Tensor] = None
    """Scalar KL(attention || indexer) per-token mean, on full layers when ctx.indexer_kl."""


class MLA(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.kv_lora_rank = config.num_attention_heads, config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.index_topk = config.index_topk
        self.scale = softmax_scale(config)
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.n_heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_cache_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, config.hidden_size, bias=bias)
        self.indexer = Indexer(config) if config.indexer_type(layer_idx) == "full" else None

    def forward(self, x: torch.Tensor, ctx: AttentionContext, shared: Optional[Selections]) -> AttentionOutput:
        """x [N, hidden] (normed); `shared`: the previous full layer's selections (used on "shared" layers).

        Writes this layer's cache rows when ctx.cache is set. Each length group attends on its own.
        """
        groups = ctx.groups
        if len(groups) == 1:
            out, selection, kl = self.attend(x, ctx, shared[0] if shared else None)
            return AttentionOutput(out, [selection], kl)
        parts = [self.attend(x.index_select(0, g.rows), g.ctx, shared[i] if shared else None)
                 for i, g in enumerate(groups)]
        out = torch.cat([p[0] for p in parts]).index_select(0, ctx.ungroup)
        kls = [p[2] * g.rows.numel() for p, g in zip(parts, groups) if p[2] is not None]
        kl = torch.stack(kls).sum() / x.shape[0] if kls else None  # the per-token mean over all groups
        return AttentionOutput(out, [p[1] for p in parts], kl)

    def attend(self, x: torch.Tensor, ctx: AttentionContext, shared: Optional[Selection]
               ) -> tuple[torch.Tensor, Optional[Selection], Optional[torch.Tensor]]:
        """Attention of one batch (or length group) -> output [N, hidden], its selection, its indexer KL."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [N, q_lora]
        q = self.q_b_proj(q_resid).view(x.shape[0], self.n_heads, -1)  # [N, h, nope + rope]
        store = self._store(self.latent(x, ctx), ctx, ctx.cache.latent[self.layer_idx] if ctx.cache else None)
        selection = self._select(x, q_resid, ctx) if self.indexer is not None else shared
        query = self.absorb_query(q, ctx.rotations)  # [N, h, kv_lora + rope]
        kl = None
        if selection is not None and (ctx.indexer_kl or ctx.batch.uses_sparse_kernel(self.index_topk)):
            out, probs = self.sparse_attention(query, store, selection)
            if self.indexer is not None and ctx.indexer_kl:
                kl = self._indexer_kl(x, q_resid, probs, selection, ctx)
        else:
            out = self.dense_attention(query, store, selection, ctx.batch)
        return self.o_proj(self.absorb_output(out).flatten(1)), selection, kl

    def latent(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x [N, hidden] -> latent rows [N, kv_lora + rope]: normed c_kv and the rotated shared rope key."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_pe, ctx.rotations)], dim=-1)

    @staticmethod
    def _store(rows: torch.Tensor, ctx: AttentionContext, pool: Optional[torch.Tensor]) -> torch.Tensor:
        """The table the batch's context slots index: the cache pool (after writing rows) or the rows."""
        if pool is None:
            return rows
        pool.index_copy_(0, ctx.batch.write_slots, rows.to(pool.dtype))
        return pool

    @torch.no_grad()
    def _select(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: AttentionContext) -> Optional[Selection]:
        """Write this layer's index keys; run the indexer when some context is longer than index_topk."""
        keys = self.indexer.keys(x, ctx.rotations)
        index_pool = ctx.cache.index_keys_of(self.layer_idx) if ctx.cache else None
        key_store = self._store(keys, ctx, index_pool)
        if not ctx.needs_selection(self.index_topk):
            return None
        q, weights = self.indexer.queries(x, q_resid, ctx.rotations)
        return self.indexer.select(q, weights, key_store, ctx.batch)

    def _kv_b(self) -> torch.Tensor:
        """kv_b_proj.weight as [h, nope + v, kv_lora]: W_kc = [:, :nope], W_vc = [:, nope:]."""
        return self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)

    def absorb_query(self, q: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """q [N, h, nope + rope] -> [N, h, kv_lora + rope]: W_kc^T q_nope, then the rotated q_rope."""
        w_kc = self._kv_b()[:, : self.nope_dim]  # [h, nope, kv_lora]
        q_latent = torch.bmm(q[..., : self.nope_dim].transpose(0, 1), w_kc)  # [h, N, kv_lora]
        return torch.cat([q_latent.transpose(0, 1), apply_rope(q[..., self.nope_dim :], rotations[:, None])], dim=-1)

    def absorb_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """[N, h, kv_lora] attention-weighted latents -> values [N, h, v] (W_vc per head)."""
        values = torch.bmm(out_latent.transpose(0, 1), self._kv_b()[:, self.nope_dim :].transpose(1, 2))  # [h, N, v]
        return values.transpose(0, 1)

    def sparse_attention(self, query: torch.Tensor, store: torch.Tensor, selection: Selection
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend over the k selected rows only -> latents [N, h, kv_lora] and probs [N, h, k]."""
        rows = gather_rows(store, selection.slots).to(query.dtype)  # [N, k, kv_lora + rope]
        scores = torch.bmm(query, rows.transpose(1, 2)) * self.scale  # [N, h, k]
        probs = scores.masked_fill(selection.invalid[:, None], float("-inf")).softmax(-1, dtype=torch.float32)
        probs = probs.to(query.dtype)
        out = torch.bmm(probs, rows)[..., : self.kv_lora_rank]  # slicing the small output: cheaper backward
        return out, probs

    def dense_attention(self, query: torch.Tensor, store: torch.Tensor, selection: Optional[Selection],
                        batch: ForwardBatch) -> torch.Tensor:
        """Attend over every context row with a causal (and selection) mask -> latents [N, h, kv_lora]."""
        rows = gather_rows(store, batch.context_slots).to(query.dtype)  # [B, Lk, kv_lora + rope]
        mask = ~batch.noncausal  # [B, Lq, Lk]
        if selection is not None:
            mask &= selection.dense_mask(batch.max_context)
        num_seqs, max_extend = mask.shape[:2]
        padded = batch.to_padded(query).view(num_seqs, max_extend * self.n_heads, -1)  # [B, Lq * h, kv_lora + rope]
        scores = torch.bmm(padded, rows.transpose(1, 2)).view(num_seqs, max_extend, self.n_heads, -1) * self.scale
        probs = scores.masked_fill(~mask[:, :, None], float("-inf")).softmax(-1, dtype=torch.float32).to(query.dtype)
        out = torch.bmm(probs.view(num_seqs, max_extend * self.n_heads, -1), rows[..., : self.kv_lora_rank])
        return batch.to_flat(out.view(num_seqs, max_extend, self.n_heads, -1))  # [N, h, kv_lora]

    def _indexer_kl(self, x: torch.Tensor, q_resid: torch.Tensor, probs: torch.Tensor, selection: Selection,
                    ctx: AttentionContext) -> torch.Tensor:
        """DeepSeek-V3.2 indexer alignment on the selected keys: mean_t KL(p_t || softmax(I_t)).

        p_t is the head-summed, L1-normalised main attention (a detached target); the indexer sees
        detached inputs, so this loss trains the indexer only.
        """
        x, q_resid = x.detach(), q_resid.detach()
        keys = gather_rows(self.indexer.keys(x, ctx.rotations), selection.slots)  # [N, k, D] (no cache in training)
        q, weights = self.indexer.queries(x, q_resid, ctx.rotations)
        scores = self.indexer.selected_scores(q, weights, keys)  # [N, k]
        log_q = scores.masked_fill(selection.invalid, float("-inf")).log_softmax(-1)
        target = probs.detach().float().sum(1)
        target = target / target.sum(-1, keepdim=True)  # [N, k]
        kl = torch.xlogy(target, target) - target * log_q.masked_fill(selection.invalid, 0.0)
        return kl.sum(-1).mean()
