"""The multi-token prediction (MTP, "NextN") layer of DeepSeek-V3 and GLM-5.

Why: one extra decoder block that predicts the token after next from the main model's hidden state
and the next token's embedding. It is the draft model of speculative decoding, and its weights ship
in the checkpoint as model.layers.{num_hidden_layers + i}.* (HF names, kept unchanged).

Wiring, as SGLang's `DeepseekModelNextN.forward` (python/sglang/srt/models/deepseek_nextn.py):

    x   = eh_proj(cat([enorm(embed(x_{t+1})), hnorm(h_t)]))     2H -> H
    x   = decoder block(x)           (an MoE layer with its own DSA indexer; `mlp_type`, `indexer_type`)
    out = shared_head.norm(x);  logits = lm_head(out)           (the main model's embedding and head)

h_t is the main model's last-layer output after its final norm (what SGLang's logits processor hands
the draft), or, for the k-th draft, this layer's own `out` of the previous draft.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncrl.model.attention import AttentionContext
from asyncrl.model.config import ModelConfig
from asyncrl.model.layers import DecoderLayer
from asyncrl.model.norm import RMSNorm


class SharedHead(nn.Module):
    """`shared_head.norm`: the MTP layer's final norm. The output head itself (`shared_head.head`) is
    the main model's lm_head, as SGLang loads it (it skips `shared_head.head` and `embed_tokens`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """A decoder layer (same submodule names, so its HF names are the usual decoder-layer ones) plus the
    MTP input projection and the shared head's norm."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """hidden [N, H] (h_t), next_embeds [N, H] (embed(x_{t+1})) -> normed output [N, H]: the input of
        lm_head, and the `hidden` of the next draft when the layer is reused."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x, _ = super().forward(x, ctx, None)
        return self.shared_head.norm(x)
