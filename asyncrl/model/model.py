"""The GLM-5 causal LM (HF `GlmMoeDsaForCausalLM`): the one model the engine and the trainer run.

Engine:   logits = model.forward_batch(ForwardBatch(...), cache)        (see batch.py, kv_cache.py)
Trainer:  out = model.token_logprobs(input_ids, cu_seqlens, targets)    (packed, differentiable)
          model.freeze_indexer(); model.set_gradient_checkpointing(True)
Both:     asyncrl.model.io.load_pretrained(dir) / save_pretrained(model, dir);
          Glm5ForCausalLM.from_config(config, seed) for a deterministic random init.

`state_dict()` keys are exactly the HF safetensors names (model.layers.N.self_attn.indexer.wq_b.weight,
model.layers.N.mlp.experts.E.gate_proj.weight, ...), so weights move to transformers / SGLang by name.
MTP layers (asyncrl.model.mtp) live in `model.mtp_layers` and are saved as model.layers.{num_hidden_layers + i}.*;
the trainer's teacher-forced entry is `model.mtp_logprobs(hidden, next_ids, cu_seqlens, targets)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from asyncrl.model.attention import AttentionContext
from asyncrl.model.batch import ForwardBatch
from asyncrl.model.config import ModelConfig
from asyncrl.model.kv_cache import KVCache
from asyncrl.model.layers import DecoderLayer
from asyncrl.model.mtp import MTPLayer
from asyncrl.model.norm import RMSNorm
from asyncrl.model.rope import RotaryEmbedding

FP32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
"""Kept in fp32 whatever the model dtype, as transformers keeps them (its strict fp32 list): the router."""


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor
    """[N] log p(targets[n] | tokens <= n of its sequence)."""
    entropy: Optional[torch.Tensor]
    """[N] entropy of the next-token distribution (None when not asked)."""
    indexer_kl: Optional[torch.Tensor]
    """Scalar indexer alignment loss (mean over full-indexer layers), when asked."""
    hidden: Optional[torch.Tensor] = None
    """[N, hidden] the final-norm hidden states: the MTP layers' input (`mtp_logprobs`)."""


@dataclass
class MTPLogprobs:
    logprobs: torch.Tensor
    """[N] log p(targets[t] | tokens <= t, next_ids[t]) under the MTP layer (fp32)."""
    predicted: torch.Tensor
    """[N] the MTP layer's most likely token: its greedy draft."""
    hidden: torch.Tensor
    """[N, hidden] the MTP layer's normed output: the `hidden` of a further draft with the same layer."""


class Glm5Model(nn.Module):
    """Embeddings, decoder layers, final norm (HF prefix `model.`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mtp_layers = nn.ModuleList(MTPLayer(config, config.num_hidden_layers + i)
                                        for i in range(config.num_nextn_predict_layers))
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.register_state_dict_post_hook(_mtp_to_hf_names)
        self.register_load_state_dict_pre_hook(_mtp_from_hf_names)

    def forward(self, batch: ForwardBatch, cache: Optional[KVCache] = None, indexer_kl: bool = False,
                routed_experts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> final hidden states [N, hidden] and the full layers' indexer losses (if asked).
        routed_experts [N, layers, k]: routing replay (DecoderLayer.forward)."""
        x = self.embed_tokens(batch.input_ids)
        ctx = AttentionContext(batch, self.rotary_emb(batch.positions), cache, indexer_kl)
        selection, losses = None, []
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, attn = checkpoint(layer, x, ctx, selection, routed_experts, use_reentrant=False)
            else:
                x, attn = layer(x, ctx, selection, routed_experts)
            selection = attn.selection
            if attn.indexer_kl is not None:
                losses.append(attn.indexer_kl)
        return self.norm(x), losses


class Glm5ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Glm5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp_shared_copies: set[str] = set()
        """Checkpoint names of MTP-layer copies of the embedding / head (model.layers.{L + i}.embed_tokens.weight,
        .shared_head.head.weight) that the loaded checkpoint had: saved again from the shared tensors (io.py)."""

    # Construction --------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> "Glm5ForCausalLM":
        """Random init, deterministic in `seed` (global RNG untouched): N(0, initializer_range) for
        projections, embeddings, experts and router; ones for norm scales; zeros for biases. MTP layers
        draw last, so the main model's weights do not depend on num_nextn_predict_layers."""
        with torch.random.fork_rng(devices=[]):
            model = cls(config)
        generator = torch.Generator().manual_seed(seed)
        params = sorted(model.named_parameters(), key=lambda item: item[0].startswith("model.mtp_layers."))
        with torch.no_grad():
            for name, param in params:
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, config.initializer_range, generator=generator)
        return model.cast(dtype)

    def cast(self, dtype: torch.dtype) -> "Glm5ForCausalLM":
        """Cast to dtype, keeping FP32_TENSORS in fp32."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if tensor.is_floating_point() and not name.endswith(FP32_TENSORS) and name != "model.rotary_emb.inv_freq":
                tensor.data = tensor.data.to(dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # Engine --------------------------------------------------------------------------------------
    def forward_batch(self, batch: ForwardBatch, cache: Optional[KVCache] = None) -> torch.Tensor:
        """Run new tokens against their cached contexts; writes their cache rows.

        -> fp32 logits [M, vocab] of rows batch.logits_indices (all N rows if None).
        """
        hidden, _ = self.model(batch, cache)
        if cache is not None and cache.hidden is not None:  # the MTP layer's input (speculative decoding)
            cache.hidden.index_copy_(0, batch.write_slots, hidden.to(cache.hidden.dtype))
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.lm_head(hidden).float()

    def draft_batch(self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache, layer: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over a batch whose input_ids are the next tokens x_{t+1} of its positions t and
        `hidden` [N, H] their h_t (or a previous draft's output); writes the layer's cache rows at the
        batch's slots. -> (fp32 logits [M, vocab] of rows batch.logits_indices, the normed output [N, H])."""
        ctx = AttentionContext(batch, self.model.rotary_emb(batch.positions), cache)
        out = self.model.mtp_layers[layer](hidden, self.model.embed_tokens(batch.input_ids), ctx)
        rows = out if batch.logits_indices is None else out[batch.logits_indices]
        return self.lm_head(rows).float(), out

    def forward(self, input_ids: torch.Tensor, **batch_options) -> torch.Tensor:
        """Full teacher-forced logits of equal-length sequences: input_ids [B, T] -> fp32 [B, T, vocab]."""
        num_seqs, length = input_ids.shape
        cu_seqlens = torch.arange(num_seqs + 1, device=input_ids.device) * length
        logits = self.forward_batch(ForwardBatch.packed(input_ids.reshape(-1), cu_seqlens, **batch_options))
        return logits.view(num_seqs, length, -1)

    # Trainer -------------------------------------------------------------------------------------
    def token_logprobs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, targets: torch.Tensor, *,
                       temperature: float | torch.Tensor = 1.0, with_entropy: bool = True, indexer_kl: bool = False,
                       routed_experts: Optional[torch.Tensor] = None, **batch_options) -> TokenLogprobs:
        """Teacher-forced log-probs of `targets` for packed sequences (no cross-sequence attention).

        input_ids, targets [N] (targets[n]: the token that follows position n; mask the last token of
        each sequence in the loss), cu_seqlens [B + 1]. Differentiable; logits are taken in fp32 and
        divided by `temperature`, a number or [N] per position (the temperature each target was sampled
        at, as the engine divides before its log_softmax). routed_experts [N, layers, k]: rollout routing
        replay (R3), the experts the engine routed each position to (rows of -1: the router decides).
        """
        batch = ForwardBatch.packed(input_ids, cu_seqlens, **batch_options)
        hidden, losses = self.model(batch, indexer_kl=indexer_kl, routed_experts=routed_experts)
        logp_all = self._log_softmax(hidden, temperature)
        logprobs = logp_all.gather(1, targets.long()[:, None]).squeeze(1)
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
        kl = torch.stack(losses).mean() if losses else None
        return TokenLogprobs(logprobs, entropy, kl, hidden)

    def mtp_logprobs(self, hidden: torch.Tensor, next_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                     targets: torch.Tensor, *, layer: int = 0, temperature: float | torch.Tensor = 1.0,
                     **batch_options) -> MTPLogprobs:
        """Teacher-forced MTP log-probs of packed sequences: position t reads [enorm(embed(next_ids[t])),
        hnorm(hidden[t])] and scores targets[t]. In a micro-batch next_ids is its `targets` (x_{t+1}) and
        targets are `mtp_targets` (x_{t+2}). hidden [N, H]: `TokenLogprobs.hidden` of the same batch, or
        `MTPLogprobs.hidden` of the previous draft. Attention stays within each sequence; MTP position t
        runs at RoPE position t.

        The main model's tensors enter detached (hidden, the shared embedding and head): an MTP loss
        trains the MTP layer only, and the main model's update is the same with or without it."""
        batch = ForwardBatch.packed(next_ids, cu_seqlens, **batch_options)
        ctx = AttentionContext(batch, self.model.rotary_emb(batch.positions))
        next_embeds = self.model.embed_tokens(next_ids).detach()
        out = self.model.mtp_layers[layer](hidden.detach(), next_embeds, ctx)
        logits = F.linear(out, self.lm_head.weight.detach()).float()
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.float()[:, None]
        logprobs = (logits / temperature).log_softmax(-1).gather(1, targets.long()[:, None]).squeeze(1)
        return MTPLogprobs(logprobs, logits.argmax(-1), out)

    def _log_softmax(self, hidden: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
        """fp32 log_softmax(lm_head(hidden) / temperature) [N, vocab]; temperature a number or [N]."""
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.float()[:, None]
        return (self.lm_head(hidden).float() / temperature).log_softmax(-1)

    def indexer_parameters(self) -> Iterator[nn.Parameter]:
        for layer in self.model.layers:
            if layer.self_attn.indexer is not None:
                yield from layer.self_attn.indexer.parameters()

    def freeze_indexer(self) -> None:
        """RL keeps the indexer fixed (GLM-5 §3.2): no gradients; build the optimizer from
        `p for p in model.parameters() if p.requires_grad` and it never touches them."""
        for param in self.indexer_parameters():
            param.requires_grad_(False)

    def freeze_mtp(self) -> None:
        """No gradients for the MTP layers: the policy loss never reaches them, but a data-parallel
        gradient sum would give them zeros that weight decay then acts on. For trainers without an MTP loss."""
        for param in self.model.mtp_layers.parameters():
            param.requires_grad_(False)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each decoder layer in backward instead of storing its activations."""
        self.model.gradient_checkpointing = enabled


def mtp_targets(targets: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP targets of a packed batch whose next-token targets are `targets`: targets[t + 1] (x_{t+2}),
    and whether it exists (False at each sequence's last position, where targets[t] stands in)."""
    valid = torch.ones_like(targets, dtype=torch.bool)
    valid[cu_seqlens[1:].long() - 1] = False
    return torch.where(valid, targets.roll(-1), targets), valid


def _mtp_to_hf_names(module: Glm5Model, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """{prefix}mtp_layers.{i}.* -> {prefix}layers.{num_hidden_layers + i}.* (the checkpoint names)."""
    for i in range(len(module.mtp_layers)):
        ours, theirs = f"{prefix}mtp_layers.{i}.", f"{prefix}layers.{len(module.layers) + i}."
        for name in [name for name in state_dict if name.startswith(ours)]:
            state_dict[theirs + name[len(ours):]] = state_dict.pop(name)


def _mtp_from_hf_names(module: Glm5Model, state_dict: dict, prefix: str, *args) -> None:
    """The inverse of _mtp_to_hf_names, before the MTP layers (and their experts' hooks) load."""
    for i in range(len(module.mtp_layers)):
        theirs, ours = f"{prefix}layers.{len(module.layers) + i}.", f"{prefix}mtp_layers.{i}."
        for name in [name for name in state_dict if name.startswith(theirs)]:
            state_dict[ours + name[len(theirs):]] = state_dict.pop(name)
