"""`KVCache`: a token-slot pool holding the compressed MLA latent and the indexer keys.

Like SGLang's token_to_kv pool: row `slot` of every layer's tensors belongs to one token of one
sequence. The engine owns allocation (which slots are free, req -> slots tables, radix prefix cache);
the model only writes the new tokens' rows (`ForwardBatch.write_slots`) and reads contexts
(`ForwardBatch.context_slots`). Prefix reuse is two sequences listing the same slots; freeing is the
engine forgetting a slot. Rows hold no sequence state, so any slot can be reused without clearing.

Per token and layer: kv_lora_rank + qk_rope_head_dim latent values (576 for GLM-5.1, vs 32768 for
the expanded keys and values transformers caches), plus index_head_dim indexer-key values on layers
with their own ("full") indexer.
"""

from __future__ import annotations

import torch

from asyncrl.model.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, max_tokens: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.max_tokens = max_tokens
        self.latent = torch.zeros(config.num_hidden_layers, max_tokens, config.kv_cache_width, dtype=dtype,
                                  device=device)
        """[layers, max_tokens, kv_lora_rank + qk_rope_head_dim]"""
        full_layers = [i for i, kind in enumerate(config.layer_indexer_types) if kind == "full"]
        self._index_row = {layer: row for row, layer in enumerate(full_layers)}
        self.index_keys = torch.zeros(len(full_layers), max_tokens, config.index_head_dim, dtype=dtype, device=device)
        """[full-indexer layers, max_tokens, index_head_dim]"""

    def index_keys_of(self, layer: int) -> torch.Tensor:
        """[max_tokens, index_head_dim] indexer keys of a layer that runs its own indexer."""
        return self.index_keys[self._index_row[layer]]

    @property
    def bytes_per_token(self) -> int:
        per_token = self.latent.shape[0] * self.latent.shape[2] + self.index_keys.shape[0] * self.index_keys.shape[2]
        return per_token * self.latent.element_size()

    @classmethod
    def for_budget(cls, config: ModelConfig, max_bytes: int, dtype: torch.dtype = torch.float32) -> "KVCache":
        """The largest pool that fits in max_bytes (the engine's memory budget)."""
        probe = cls(config, 1, dtype)
        return cls(config, max(1, max_bytes // probe.bytes_per_token), dtype)
