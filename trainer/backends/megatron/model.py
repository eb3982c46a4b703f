"""GLM-5 as a megatron-core GPTModel: asyncrl's ModelConfig -> MLATransformerConfig + layer specs.

Every layer is megatron's own modules: AbsorbedMLASelfAttention with DSAttention / DSAIndexer
(experimental_attention_variant), TransformerLayer, MoELayer (TopKRouter with sigmoid scores, expert
bias, group-limited top-k, top-k scaling, shared experts) or a dense MLP per `mlp_layer_types`.
The flags below make megatron compute what transformers' `glm_moe_dsa` computes; the differences
megatron cannot express are listed in docs/megatron.md ("What differs").

Local (non-Transformer-Engine) modules are used, so the same model runs on CPU (with
cpu_shims) and on GPUs without TE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model.config import ModelConfig

INDEXER_K_NORM_EPS = 1e-6
"""transformers' indexer key LayerNorm eps (GlmMoeDsaIndexer.k_norm)."""
LATENT_NORM_EPS = 1e-6
"""transformers' q_a_layernorm / kv_a_layernorm eps (GlmMoeDsaRMSNorm default; not rms_norm_eps)."""


@dataclass(frozen=True)
class ParallelSizes:
    tensor: int = 1
    expert: int = 1


def transformer_config(arch: ModelConfig, parallel: ParallelSizes, dtype: torch.dtype, recompute: bool = False):
    """The MLATransformerConfig that reproduces `arch` (HF glm_moe_dsa semantics). `recompute`:
    megatron's full activation recomputation, one layer at a time (trainer.grad_checkpointing)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    check_supported(arch, parallel)
    return MLATransformerConfig(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim,
        qk_pos_emb_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        qk_layernorm=True,  # MLA's q_a / kv_a latent RMSNorms
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        **_rope_fields(arch),
        apply_rope_fusion=False,
        **_moe_fields(arch, parallel),
        **_dsa_fields(arch),
        **_parallel_fields(parallel, dtype, recompute),
    )


def _moe_fields(arch: ModelConfig, parallel: ParallelSizes) -> dict:
    """MoE: sigmoid router in fp32, bias-corrected choice, group-limited, normalised x scaling."""
    return dict(
        num_moe_experts=arch.n_routed_experts,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_shared_expert_intermediate_size=arch.moe_intermediate_size * arch.n_shared_experts or None,
        moe_layer_freq=[1 if kind == "sparse" else 0 for kind in arch.layer_mlp_types],
        moe_router_topk=arch.num_experts_per_tok,
        moe_enable_routing_replay=True,  # routers take replayed experts when a micro-batch brings them (R3)
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=arch.n_group if arch.n_group > 1 else None,
        moe_router_group_topk=arch.topk_group if arch.n_group > 1 else None,
        moe_router_topk_scaling_factor=arch.routed_scaling_factor,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall" if parallel.expert > 1 else "allgather",
        moe_grouped_gemm=False,
    )


def _dsa_fields(arch: ModelConfig) -> dict:
    """DSA: GLM-5 indexer (interleaved RoPE, ReLU scores, no Hadamard rotation, eps 1e-6 k_norm)."""
    freq, offset = indexer_share_schedule(arch.layer_indexer_types)
    return dict(
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=arch.index_n_heads,
        dsa_indexer_head_dim=arch.index_head_dim,
        dsa_indexer_topk=arch.index_topk,
        dsa_indexer_topk_freq=freq,
        dsa_indexer_skip_topk_offset=offset,
        dsa_indexer_loss_coeff=0.0,
        dsa_indexer_rope_interleaved=True,
        dsa_indexer_rotate_activation=False,
        dsa_indexer_scoring_relu=True,
        dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS,
    )


def _parallel_fields(parallel: ParallelSizes, dtype: torch.dtype, recompute: bool) -> dict:
    """Parallelism and precision."""
    return dict(
        tensor_model_parallel_size=parallel.tensor,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=1,  # experts are whole on their EP rank (no TP split inside an expert)
        sequence_parallel=parallel.tensor > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights always come from an HF state dict (hf_weights)
        transformer_impl="local",
        calculate_per_token_loss=True,  # DDP sums gradients; the loss already carries the step normalizer
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
    )


def _rope_fields(arch: ModelConfig) -> dict:
    params = arch.rope_parameters
    if params.get("rope_type", "default") == "default":
        return dict(rope_type="rope", rotary_base=arch.rope_theta, rotary_percent=1.0, mscale_all_dim=0.0)
    return dict(rope_type="yarn", rotary_base=arch.rope_theta, rotary_scaling_factor=params["factor"],
                original_max_position_embeddings=params["original_max_position_embeddings"],
                beta_fast=params.get("beta_fast") or 32, beta_slow=params.get("beta_slow") or 1,
                mscale=params.get("mscale") or 1.0, mscale_all_dim=params.get("mscale_all_dim") or 0.0)


def indexer_share_schedule(indexer_types: list[str]) -> tuple[int, int]:
    """(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) whose schedule equals `indexer_types`.

    megatron (1-based layer L) reuses the previous top-k when max(L - offset, 0) % freq != 0, the
    formula HF derives indexer_types from; an explicit list that fits no (freq, offset) is refused.
    """
    from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer

    n = len(indexer_types)
    for freq in range(1, n + 1):
        for offset in range(1, n + 1):
            shared = [is_dsa_skip_topk_layer(layer, offset, freq) for layer in range(1, n + 1)]
            if shared == [kind == "shared" for kind in indexer_types]:
                return freq, offset
    raise ValueError(f"megatron backend: indexer_types {indexer_types} is not a (freq, offset) schedule")


def check_supported(arch: ModelConfig, parallel: ParallelSizes) -> None:
    """Refuse configurations megatron would compute differently from transformers."""
    problems = [
        (arch.attention_bias, "attention_bias=True (AbsorbedMLA has no biases)"),
        (not arch.norm_topk_prob and arch.num_experts_per_tok > 1,
         "norm_topk_prob=False (megatron's sigmoid router always normalises top-k weights)"),
        (arch.n_group > 1 and arch.num_experts_per_tok // arch.topk_group != 2,
         "group scores: megatron sums the top (top_k // topk_group) scores of a group, HF the top 2"),
        (arch.rope_parameters.get("rope_type", "default") not in ("default", "yarn"), "rope_type"),
        (arch.vocab_size % parallel.tensor != 0, "vocab_size must be divisible by the tensor-parallel size"),
        (arch.num_attention_heads % parallel.tensor != 0, "heads must be divisible by the tensor-parallel size"),
        (arch.n_routed_experts % parallel.expert != 0, "experts must be divisible by the expert-parallel size"),
    ]
    for failed, message in problems:
        if failed:
            raise ValueError(f"megatron backend does not support {message}")


# Layer specs ------------------------------------------------------------------------------------
class DuplicatedLinear(nn.Linear):
    """The plain, replicated linear layer the DSA spec asks its backend for (`backend.linear()`, TE's
    TELinear(parallel_mode="duplicated") in megatron): the indexer's wq_b, wk, weights_proj, which run
    on sequence-gathered rows. Megatron calling convention: extra constructor kwargs are accepted,
    forward returns (out, bias)."""

    sees_sequence_shards = False

    def __init__(self, input_size: int, output_size: int, *, config, bias: bool = False, **_megatron_kwargs):
        super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype)
        for param in self.parameters():  # grads of sequence-sharded inputs are summed over TP ranks
            param.sequence_parallel = config.sequence_parallel and self.sees_sequence_shards

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


class LatentDownProjection(DuplicatedLinear):
    """q_a_proj / kv_a_proj_with_mqa: replicated weights on sequence-parallel rows, AbsorbedMLA's
    `Linear` branch. (Its ColumnParallelLinear branch loses the other TP ranks' gradient of the
    shared rope key k_pe: measured 1e-4 gradient errors at TP=2, see docs/megatron.md.)"""

    sees_sequence_shards = True


class TorchNorm:
    """megatron LayerNormBuilder over torch.nn.RMSNorm / LayerNorm (per config.normalization).

    megatron's own WrappedTorchNorm refuses sequence parallelism, which AbsorbedMLA and MoE need under
    TP > 1. A norm that sees sequence-sharded rows gets `sequence_parallel` set on its parameters,
    the attribute megatron's finalize_model_grads all-reduces over TP ranks (as TE's norms do).
    """

    fixed_eps: Optional[float] = None
    sees_sequence_shards = True

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_megatron_kwargs) -> nn.Module:
        norm_cls = nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm
        norm = norm_cls(hidden_size, eps=cls.fixed_eps or eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel and cls.sees_sequence_shards
        return norm


class LatentNorm(TorchNorm):
    """q_a_layernorm / kv_a_layernorm: transformers uses eps 1e-6 here, not rms_norm_eps (which
    AbsorbedMLA would pass)."""

    fixed_eps = LATENT_NORM_EPS


class IndexerKeyNorm(TorchNorm):
    """The indexer's key LayerNorm: it runs on sequence-gathered rows (grads already equal across TP)."""

    sees_sequence_shards = False


def _local_backend():
    from megatron.core.models.backends import LocalSpecProvider

    class LocalDSASpecProvider(LocalSpecProvider):
        """megatron's local backend plus the `linear()` the DSA spec needs, and sequence-parallel norms."""

        def linear(self) -> type:
            return DuplicatedLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
            return IndexerKeyNorm if for_qk else TorchNorm

    return LocalDSASpecProvider()


def decoder_block_spec(config):
    """Per-layer TransformerLayer specs (DSA attention everywhere, MoE or dense MLP) + final RMSNorm."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    # AbsorbedMLA accepts its down projections only as one of [modelopt's TE-based Linear,
    # TEColumnParallelLinear, ColumnParallelLinear]; without TE the first is None: fill it in.
    absorbed_mla.Linear = LatentDownProjection
    backend = _local_backend()
    layer_specs = get_transformer_layer_with_experimental_attention_variant_spec(config, backend)
    for spec in layer_specs:  # the attention spec object is shared by all layers
        attention = spec.submodules.self_attention.submodules
        attention.linear_q_down_proj = attention.linear_kv_down_proj = LatentDownProjection
        attention.q_layernorm = attention.kv_layernorm = LatentNorm
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=backend.layer_norm(rms_norm=True))


def build_gpt_model(arch: ModelConfig, parallel: ParallelSizes, dtype: torch.dtype,
                    device: Optional[torch.device] = None, recompute: bool = False):
    """The megatron GPTModel of `arch` (uninitialised weights: load them with hf_weights)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(arch, parallel, dtype, recompute)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",  # ignored by MLA layers, which apply their own RoPE
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        parallel_output=True,  # logits stay vocab-sharded: log-probs are vocab-parallel
    )
    for module in model.modules():
        if hasattr(module, "frozen_expert_bias"):  # the TopKRouters
            module.frozen_expert_bias = True  # e_score_correction_bias is a checkpoint value, not trained
            module.weight.data = module.weight.data.float()  # HF keeps the router fp32 (megatron: params_dtype)
    return model.to(device) if device is not None else model
