"""A minimal batched generator over the slot-pool cache: the reference loop an engine elaborates.

Each sequence owns a contiguous row of slots (req_to_token in SGLang terms); one call prefills every
prompt, then each step decodes one token for all live sequences in a single forward_batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from asyncrl.model.batch import ForwardBatch
from asyncrl.model.kv_cache import KVCache
from asyncrl.model.model import Glm5ForCausalLM


def greedy_generate(model: Glm5ForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """-> the max_new_tokens greedy continuations (no stop tokens: a fixed-length benchmark loop)."""
    return generate(model, prompts, max_new_tokens)


@torch.no_grad()
def generate(model: Glm5ForCausalLM, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, stop_ids: Sequence[int] = ()) -> list[list[int]]:
    """-> the continuations of `prompts`: greedy (temperature 0) or sampled from softmax(logits / temperature)
    with a generator seeded by `seed`; each ends at its first stop token (kept) or after max_new_tokens."""
    width, device = max(len(p) for p in prompts) + max_new_tokens, model.device
    cache = KVCache(model.config, len(prompts) * width, dtype=model.dtype, device=device)
    req_to_token = torch.arange(len(prompts) * width, device=device).view(len(prompts), width)  # [B, width] slots
    rng = torch.Generator(device=device).manual_seed(seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        return torch.multinomial((logits / temperature).softmax(-1), 1, generator=rng).squeeze(1)

    lens = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    batch = ForwardBatch(ids, lens.clone(), req_to_token[:, : int(lens.max())], lens.clone(),
                         logits_indices=lens.cumsum(0) - 1)
    tokens = pick(model.forward_batch(batch, cache))  # [B]
    out = [tokens]
    ones = torch.ones_like(lens)
    for _ in range(max_new_tokens - 1):
        lens += 1
        batch = ForwardBatch(tokens, ones, req_to_token[:, : int(lens.max())], lens)
        tokens = pick(model.forward_batch(batch, cache))
        out.append(tokens)
    continuations = torch.stack(out, dim=1).tolist()
    stops = set(stop_ids)
    return [next((row[:i + 1] for i, t in enumerate(row) if t in stops), row) for row in continuations]
