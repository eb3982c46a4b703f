"""The MTP layer's forward batches inside the scheduler (speculative decoding, rollout/speculative.py).

Convention: MTP position t reads (h_t, x_{t+1}) and keeps its KV rows in the slot of position t + 1,
the slot of x_{t+1}. Its rows then depend on tokens 0..t+1 only, exactly like the target's rows of that
slot, so the radix cache shares both with any request whose prefix covers the slot. The MTP context
of position t is slots 1..t+1 of the request (RoPE position = index in it, t for the query). The pool
keeps h of every slot (`KVCache.hidden`), so MTP positions can be computed from any point of a
request, cached prefix or not, without recomputing the target.

A request's `mtp_done`: its MTP positions [0, mtp_done) have their rows. A step of speculative
decoding (Scheduler._compute_verify), for a request whose target KV covers positions [0, c) and whose
pending token is x_c, with slots allocated for positions c..c + k:
1. catch up: MTP positions [mtp_done, c) in one extend (from the hidden rows); the last one drafts d_1;
2. chain: MTP positions c..c + k - 2, one token each, fed the previous output and draft, draft d_2..d_k
   (their rows are provisional: step 1 of the next step rewrites the accepted ones from the target's h);
3. verify [x_c, d_1..d_k] with the target, positions c..c + k.
"""

from __future__ import annotations

from typing import Callable

import torch

from asyncrl.model.batch import ForwardBatch
from rollout.request import Req

DraftForward = Callable[[torch.Tensor, ForwardBatch], tuple[torch.Tensor, torch.Tensor]]
"""(hidden [N, H], batch of next tokens) -> (logits [M, V] of batch.logits_indices, output [N, H]):
the MTP layer over the KV pool (Glm5ForCausalLM.draft_batch)."""


class Drafter:
    def __init__(self, forward: DraftForward, read_hidden: Callable[[torch.Tensor], torch.Tensor],
                 req_to_slot: torch.Tensor) -> None:
        self.forward = forward
        self.read_hidden = read_hidden
        self.req_to_slot = req_to_slot

    def catch_up(self, spans: list[tuple[Req, int]], want_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP positions [req.mtp_done, end) of each (req, end) (end > mtp_done; x_end known and slots up to
        end allocated), one extend. -> logits [B, V] (if wanted) and outputs [B, H] of each span's last position."""
        ids, rows, cols, extend_lens, ends = [], [], [], [], []
        for req, end in spans:
            ids.extend(req.token_slice(req.mtp_done + 1, end + 1))
            rows.extend([req.row] * (end - req.mtp_done))
            cols.extend(range(req.mtp_done, end))
            extend_lens.append(end - req.mtp_done)
            ends.append(end)
        lens = torch.tensor(extend_lens)
        last = lens.cumsum(0) - 1
        batch = self._batch(spans, torch.tensor(ids), lens, ends, last if want_logits else last[:0])
        logits, out = self.forward(self.read_hidden(self.req_to_slot[rows, cols]), batch)
        return logits, out[last]

    def chain(self, reqs: list[Req], positions: list[int], tokens: torch.Tensor, hidden: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP position per request (positions[i], whose next token is tokens[i], hidden[i] the
        previous draft's output) -> logits [B, V] and outputs [B, H]."""
        batch = self._batch([(r, p + 1) for r, p in zip(reqs, positions)], tokens,
                            torch.ones(len(reqs), dtype=torch.long), [p + 1 for p in positions], None)
        return self.forward(hidden, batch)

    def _batch(self, spans: list[tuple[Req, int]], ids: torch.Tensor, extend_lens: torch.Tensor, ends: list[int],
               logits_indices) -> ForwardBatch:
        """MTP positions ending at `ends` (exclusive): context slots 1..end of each request."""
        rows = [req.row for req, _ in spans]
        return ForwardBatch(input_ids=ids.long(), extend_lens=extend_lens,
                            context_slots=self.req_to_slot[rows, 1:max(ends) + 1], context_lens=torch.tensor(ends),
                            logits_indices=logits_indices)
