"""One decoder layer: pre-norm MLA, then pre-norm MLP (first_k_dense_replace layers) or MoE."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from asyncrl.model.attention import MLA, AttentionContext, AttentionOutput, Selections
from asyncrl.model.config import ModelConfig
from asyncrl.model.moe import MLP, MoE
from asyncrl.model.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = MLA(config, layer_idx)
        dense = config.mlp_type(layer_idx) == "dense"
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if dense else MoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: AttentionContext, shared: Optional[Selections],
                replay: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, AttentionOutput]:
        """x [N, hidden] -> [N, hidden], and the attention's selection / indexer loss.
        replay [N, layers, k]: routing replay (R3), the experts every MoE layer must use (-1: its own choice)."""
        attn = self.self_attn(self.input_layernorm(x), ctx, shared)
        x = x + attn.out
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MLP):
            return x + self.mlp(h), attn
        out, experts = self.mlp(h, replay[:, self.layer_idx] if replay is not None else None)
        if ctx.cache is not None:
            ctx.cache.record_routing(self.layer_idx, ctx.batch.write_slots, experts)
        return x + out, attn
