"""A minimal batched greedy generator over the slot-pool cache: the reference loop an engine elaborates.

Each sequence owns a contiguous row of slots (req_to_token in SGLang terms); one call prefills every
prompt, then each step decodes one token for all live sequences in a single forward_batch.
"""

from __future__ import annotations

import torch

from asyncrl.model.batch import ForwardBatch
from asyncrl.model.kv_cache import KVCache
from asyncrl.model.model import Glm5ForCausalLM


@torch.no_grad()
def greedy_generate(model: Glm5ForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """-> the max_new_tokens greedy continuations (no stop tokens: a fixed-length benchmark loop)."""
    width, device = max(len(p) for p in prompts) + max_new_tokens, model.device
    cache = KVCache(model.config, len(prompts) * width, dtype=model.dtype, device=device)
    req_to_token = torch.arange(len(prompts) * width, device=device).view(len(prompts), width)  # [B, width] slots
    lens = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    batch = ForwardBatch(ids, lens.clone(), req_to_token[:, : int(lens.max())], lens.clone(),
                         logits_indices=lens.cumsum(0) - 1)
    tokens = model.forward_batch(batch, cache).argmax(-1)  # [B]
    out = [tokens]
    ones = torch.ones_like(lens)
    for _ in range(max_new_tokens - 1):
        lens += 1
        batch = ForwardBatch(tokens, ones, req_to_token[:, : int(lens.max())], lens)
        tokens = model.forward_batch(batch, cache).argmax(-1)
        out.append(tokens)
    return torch.stack(out, dim=1).tolist()
