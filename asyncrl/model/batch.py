"""`ForwardBatch`: the one input type of a model forward, for the engine and the trainer alike.

A ragged batch of B sequences. Each sequence brings its new tokens (a prefill chunk, or one decode
token) and the slot ids of its *whole* context in order (cached prefix, then the new tokens). Slots
index the rows of a `KVCache` (the engine allocates them); new tokens' latents are written to their
slots, then every query attends over its sequence's context. A context is always the sequence from
position 0, so a token's position is its index in the context. Two sequences that list the same
slots share a cached prefix.

Without a cache (teacher-forced training) the "slots" are flat row indices into the batch's own
tokens: `ForwardBatch.packed(input_ids, cu_seqlens)` builds that, with no cross-sequence attention.

Queries are laid out padded per sequence ([B, Lq], Lq = longest extend) where the indexer and the
dense attention need per-sequence key matrices, and flat ([N]) everywhere else. A mix of prefill
chunks and decode tokens in one call is correct, but costs B x Lq in the indexer: schedule prefill
and decode in separate calls (as SGLang does by default) when that matters. Multi-query batches of very
different context lengths are split for attention into length groups (`length_groups`, `subset`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Optional, Sequence

import torch

AttentionImpl = Literal["auto", "sparse", "dense"]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    """[N] int64: new tokens of all sequences, one sequence after the other."""
    extend_lens: torch.Tensor
    """[B] int64: new tokens per sequence (>= 1)."""
    context_slots: torch.Tensor
    """[B, Lk] int64: slot ids of each sequence's context, position order, right-padded (any valid slot).
    Lk should be the longest context: a wider table is correct but every layer pays for the extra width."""
    context_lens: torch.Tensor
    """[B] int64: context length (cached prefix + new tokens) of each sequence."""
    logits_indices: Optional[torch.Tensor] = None
    """[M] int64: rows of `input_ids` whose logits are returned (None: all N rows)."""
    attention_impl: AttentionImpl = "auto"
    """`sparse`: gather only the selected keys (O(T*k)). `dense`: masked attention over the whole context
    (reference, O(T^2)). `auto`: sparse for decode batches (one query per sequence) and for contexts longer
    than dense_context_ratio * index_topk; dense otherwise (per-sequence GEMMs beat per-query k-row gathers
    on CPU there). Within index_topk no selection is needed and the indexer is skipped. Both kernels
    compute the same function (measured: equal within 1e-6)."""
    dense_context_ratio: float = 4.0
    """`auto` keeps the dense kernel for multi-query batches while max_context <= this x index_topk."""
    max_score_elements: int = 1 << 22
    """Indexer scores are computed in query chunks of at most this many fp32 values (16 MiB): the
    indexer's memory stays O(T) instead of O(T^2) for long prefills."""
    group_length_ratio: float = 2.0
    """Multi-query batches (prefill, training) whose context lengths differ a lot run attention and the
    indexer per group of similar lengths: a sequence starts a new group when its context is shorter
    than 1 / ratio of its group's longest. One padded [B, Lq, Lk] layout would make every sequence pay
    the longest one's Lq x Lk (a 512-token sample packed with 64-token ones: ~3x slower training).
    0 disables. Decode batches (one query per sequence) are never split."""
    group_min_pairs: int = 1 << 16
    """Grouping is skipped when the padded layout has fewer query-key pairs than this (cheap anyway)."""

    # Derived in __post_init__ ---------------------------------------------------------------------
    positions: torch.Tensor = field(init=False)
    """[N]: position of each new token in its sequence."""
    write_slots: torch.Tensor = field(init=False)
    """[N]: slot that receives each new token's latent."""
    query_rows: torch.Tensor = field(init=False)
    """[B, Lq]: flat row of each padded query (pad entries point at row 0)."""
    query_positions: torch.Tensor = field(init=False)
    """[B, Lq]: position of each padded query (0 for pads)."""
    padded_rows: torch.Tensor = field(init=False)
    """[N]: index of each flat row in the padded [B * Lq] layout."""
    _rectangular: bool = field(init=False, repr=False)
    _first_ranked_row: dict[int, int] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        device = self.input_ids.device
        num_seqs, num_tokens = self.extend_lens.numel(), self.input_ids.numel()
        if int(self.extend_lens.sum()) != num_tokens:
            raise ValueError(f"ForwardBatch: extend_lens sum to {int(self.extend_lens.sum())}, "
                             f"input_ids has {num_tokens}")
        if bool((self.extend_lens > self.context_lens).any()) or bool((self.extend_lens < 1).any()):
            raise ValueError("ForwardBatch: each sequence needs 1 <= extend_len <= context_len")
        if int(self.context_lens.max()) > self.context_slots.shape[1]:
            raise ValueError("ForwardBatch: context_slots is narrower than the longest context")
        seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), self.extend_lens)  # [N]
        starts = torch.cumsum(self.extend_lens, 0) - self.extend_lens  # [B] first flat row of each sequence
        offset = torch.arange(num_tokens, device=device) - starts[seq]  # [N] index among the new tokens
        self.positions = self.context_lens[seq] - self.extend_lens[seq] + offset
        self.write_slots = self.context_slots[seq, self.positions]
        max_extend = int(self.extend_lens.max())
        self.padded_rows = seq * max_extend + offset
        self.query_rows = torch.zeros(num_seqs * max_extend, dtype=torch.long, device=device)
        self.query_rows[self.padded_rows] = torch.arange(num_tokens, device=device)
        self.query_rows = self.query_rows.view(num_seqs, max_extend)
        self.query_positions = torch.zeros(num_seqs * max_extend, dtype=torch.long, device=device)
        self.query_positions[self.padded_rows] = self.positions
        self.query_positions = self.query_positions.view(num_seqs, max_extend)
        self._rectangular = num_tokens == num_seqs * max_extend  # no padding: padded <-> flat are views

    def uses_sparse_kernel(self, index_topk: int) -> bool:
        if self.attention_impl == "auto":
            return self.query_rows.shape[1] == 1 or self.max_context > self.dense_context_ratio * index_topk
        return self.attention_impl == "sparse"

    # Indexer constants, computed once per forward and shared by every full-indexer layer -----------
    @cached_property
    def noncausal(self) -> torch.Tensor:
        """[B, Lq, Lk] bool: key position > query position (padding keys included)."""
        key_pos = torch.arange(self.max_context, device=self.input_ids.device)
        return key_pos > self.query_positions[..., None]

    @cached_property
    def position_tiebreak(self) -> torch.Tensor:
        """[Lk] int64: the low 32 bits of the indexer's rank key, larger for lower positions (ties go to them)."""
        return 0x7FFFFFFF - torch.arange(self.max_context, device=self.input_ids.device)

    def first_ranked_row(self, k: int) -> int:
        """First padded query row where some query sits at position >= k (earlier rows take every causal key)."""
        if k not in self._first_ranked_row:
            ranked = (self.query_positions >= k).any(0)  # [Lq]; positions grow along a row
            self._first_ranked_row[k] = int(ranked.int().argmax()) if bool(ranked.any()) else ranked.numel()
        return self._first_ranked_row[k]

    @property
    def num_seqs(self) -> int:
        return self.extend_lens.numel()

    @property
    def max_context(self) -> int:
        return self.context_slots.shape[1]

    def to_padded(self, flat: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, Lq, ...] (pad rows repeat row 0; their outputs are never read)."""
        if self._rectangular:
            return flat.view(*self.query_rows.shape, *flat.shape[1:])
        return flat.index_select(0, self.query_rows.flatten()).view(*self.query_rows.shape, *flat.shape[1:])

    def to_flat(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, Lq, ...] -> [N, ...]."""
        if self._rectangular:
            return padded.reshape(-1, *padded.shape[2:])
        return padded.flatten(0, 1).index_select(0, self.padded_rows)

    # Length groups (attention of multi-query batches) ----------------------------------------------
    def length_groups(self) -> list[list[int]]:
        """Sequence indices grouped by similar context length (longest first), or one group of all."""
        num_seqs, max_extend = self.query_rows.shape
        if (self.group_length_ratio <= 0 or num_seqs == 1 or max_extend == 1
                or num_seqs * max_extend * self.max_context < self.group_min_pairs):
            return [list(range(num_seqs))]
        lengths = self.context_lens.tolist()
        groups: list[list[int]] = []
        for i in sorted(range(num_seqs), key=lambda i: (-lengths[i], i)):
            if groups and lengths[i] * self.group_length_ratio >= lengths[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def subset(self, seqs: Sequence[int], slots_are_rows: bool) -> tuple[torch.Tensor, "ForwardBatch"]:
        """-> the flat rows of sequences `seqs` (in that order) and a batch of just them. `slots_are_rows`:
        the context slots index this batch's own rows (no cache), so they are renumbered into the subset's."""
        device = self.input_ids.device
        index = torch.tensor(seqs, device=device)
        starts = torch.cumsum(self.extend_lens, 0) - self.extend_lens
        ext = self.extend_lens[index]
        first = torch.repeat_interleave(starts[index] - (torch.cumsum(ext, 0) - ext), ext)  # [n] row offset
        rows = first + torch.arange(int(ext.sum()), device=device)  # [n] flat rows of the subset, in order
        slots = self.context_slots[index, : int(self.context_lens[index].max())]
        if slots_are_rows:
            renumber = torch.zeros(self.input_ids.numel(), dtype=torch.long, device=device)
            renumber[rows] = torch.arange(rows.numel(), device=device)
            slots = renumber[slots]
        sub = ForwardBatch(self.input_ids[rows], ext, slots, self.context_lens[index],
                           attention_impl=self.attention_impl, dense_context_ratio=self.dense_context_ratio,
                           max_score_elements=self.max_score_elements, group_length_ratio=0)
        return rows, sub

    # Constructors ---------------------------------------------------------------------------------
    @classmethod
    def packed(cls, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, **kwargs) -> "ForwardBatch":
        """Teacher-forced batch without a cache: flat tokens [N], cu_seqlens [B + 1] (0, ..., N)."""
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        width = int(lens.max())
        slots = cu_seqlens[:-1, None].long() + torch.arange(width, device=input_ids.device)  # [B, Lk]
        slots = torch.where(slots < cu_seqlens[1:, None], slots, torch.zeros_like(slots))
        return cls(input_ids.long(), lens, slots, lens, **kwargs)

    @classmethod
    def from_lists(cls, new_tokens: Sequence[Sequence[int]], context_slots: Sequence[Sequence[int]],
                   logits: Literal["last", "all"] = "last", device: torch.device | str = "cpu", **kwargs
                   ) -> "ForwardBatch":
        """Convenience: per sequence its new token ids and the slot ids of its whole context. (An engine
        keeps a req_to_token tensor instead and slices context_slots out of it: no Python lists per step.)"""
        if len(new_tokens) != len(context_slots):
            raise ValueError("ForwardBatch.from_lists: one context_slots list per sequence")
        width = max(len(s) for s in context_slots)

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        slots = tensor([list(s) + [s[0]] * (width - len(s)) for s in context_slots])
        ext = tensor([len(t) for t in new_tokens])
        last = torch.cumsum(ext, 0) - 1
        return cls(tensor([t for seq in new_tokens for t in seq]), ext, slots, tensor([len(s) for s in context_slots]),
                   logits_indices=last if logits == "last" else None, **kwargs)
