"""`KVCache`: a token-slot pool holding the compressed MLA latent and the indexer keys.

Like SGLang's token_to_kv pool: row `slot` of every layer's tensors belongs to one token of one
sequence. The engine owns allocation (which slots are free, req -> slots tables, radix prefix cache);
the model only writes the new tokens' rows (`ForwardBatch.write_slots`) and reads contexts
(`ForwardBatch.context_slots`). Prefix reuse is two sequences listing the same slots; freeing is the
engine forgetting a slot. Rows hold no sequence state, so any slot can be reused without clearing.

Per token and layer: kv_lora_rank + qk_rope_head_dim latent values (576 for GLM-5.1, vs 32768 for
the expanded keys and values transformers caches), plus index_head_dim indexer-key values on layers
with their own ("full") indexer. With `record_routing`, also the experts each MoE layer routed the token
to (SGLang's --enable-return-routed-experts keeps the same per-slot table): what rollout routing replay
(R3) hands the trainer, valid for as long as the slot holds the token, cached prefixes included.
"""

from __future__ import annotations

import torch

from asyncrl.model.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, max_tokens: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", record_routing: bool = False, mtp: bool = False):
        self.max_tokens = max_tokens
        self.num_hidden_layers = config.num_hidden_layers
        mtp_layers = config.num_nextn_predict_layers if mtp else 0
        self.latent = torch.zeros(config.num_hidden_layers + mtp_layers, max_tokens, config.kv_cache_width,
                                  dtype=dtype, device=device)
        """[layers (+ MTP layers), max_tokens, kv_lora_rank + qk_rope_head_dim]"""
        full_layers = [i for i, kind in enumerate(config.layer_indexer_types) if kind == "full"]
        full_layers += [config.num_hidden_layers + i for i in range(mtp_layers)]  # each MTP layer has its own indexer
        self.hidden = torch.zeros(max_tokens, config.hidden_size, dtype=dtype, device=device) if mtp else None
        """[max_tokens, hidden] with `mtp` (speculative decoding): the target's final-norm hidden state of each
        slot's token, the MTP layer's input, so MTP positions can be computed for any cached prefix.
        The MTP layer's own rows follow the one-slot-later convention of rollout/drafting.py."""
        self._index_row = {layer: row for row, layer in enumerate(full_layers)}
        self.index_keys = torch.zeros(len(full_layers), max_tokens, config.index_head_dim, dtype=dtype, device=device)
        """[full-indexer layers, max_tokens, index_head_dim]"""
        self.routed_experts = (torch.full((max_tokens, config.num_hidden_layers, config.num_experts_per_tok), -1,
                                          dtype=torch.int32, device=device) if record_routing else None)
        """[max_tokens, layers, num_experts_per_tok] int32 expert ids, -1 on dense layers (record_routing only)."""

    def record_routing(self, layer: int, slots: torch.Tensor, experts: torch.Tensor) -> None:
        """Note the experts [N, k] a MoE layer chose for the tokens written to `slots` [N] (if recording)."""
        if self.routed_experts is not None and layer < self.num_hidden_layers:  # MTP layers: not replayed
            self.routed_experts[slots, layer] = experts.to(torch.int32)

    def index_keys_of(self, layer: int) -> torch.Tensor:
        """[max_tokens, index_head_dim] indexer keys of a layer that runs its own indexer."""
        return self.index_keys[self._index_row[layer]]

    @property
    def bytes_per_token(self) -> int:
        per_token = self.latent.shape[0] * self.latent.shape[2] + self.index_keys.shape[0] * self.index_keys.shape[2]
        per_token += self.hidden.shape[1] if self.hidden is not None else 0
        routing = self.routed_experts[0].nbytes if self.routed_experts is not None else 0
        return per_token * self.latent.element_size() + routing
