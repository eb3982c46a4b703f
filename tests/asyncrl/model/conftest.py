"""Model test fixtures: small GLM-5 configs that exercise every feature, and transformers as the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.model.config import ModelConfig
from asyncrl.model.model import Glm5ForCausalLM

PARITY_CONFIG = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    index_n_heads=16, index_head_dim=32, index_topk=16, indexer_types=["full", "full", "shared", "full"],
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    initializer_range=0.1, max_position_embeddings=1024, eos_token_id=[1, 2],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
""">= 16 index heads, first-k dense, n_group > 1, a shared expert, a shared-indexer layer, and
index_topk 16 so any context over 16 tokens attends sparsely. initializer_range 0.1 gives O(1) logits."""


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Small ops on a shared 2-core machine: a second intra-op thread mostly waits (measured 30x slower
    decode steps under load), so the model tests run single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def parity_config() -> ModelConfig:
    return dataclasses.replace(PARITY_CONFIG)


def randomize_expert_bias(model: torch.nn.Module, seed: int = 0) -> None:
    """Random init leaves e_score_correction_bias at zero; give it values so routing depends on it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)


@pytest.fixture
def parity_model(parity_config) -> Glm5ForCausalLM:
    model = Glm5ForCausalLM.from_config(parity_config, seed=0).eval()
    randomize_expert_bias(model)
    return model


@pytest.fixture(scope="session")
def hf_causal_lm():
    """transformers' GlmMoeDsaForCausalLM class (imported once: ~5 s)."""
    transformers = pytest.importorskip("transformers")
    assert transformers.__version__ == "5.24.0", "parity is pinned against transformers 5.24.0"
    return transformers.GlmMoeDsaForCausalLM


@pytest.fixture(scope="session")
def load_hf(hf_causal_lm):
    """path -> transformers model (eager attention, fp32, eval)."""
    return lambda path: hf_causal_lm.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture
def randomize_bias():
    return randomize_expert_bias
