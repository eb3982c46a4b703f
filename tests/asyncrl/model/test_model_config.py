"""configs/model/*.yaml load through the run-config schema; GLM-5.1 dimensions match REFERENCE.md and HF."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncrl.config import ModelSection
from asyncrl.model.config import ModelConfig

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "model"


def load_section(name: str) -> ModelSection:
    merged = OmegaConf.merge(OmegaConf.structured(ModelSection), OmegaConf.load(CONFIGS / f"{name}.yaml"))
    return OmegaConf.to_object(merged)


def test_glm5_1_yaml_has_the_published_dimensions():
    arch = load_section("glm5_1").arch
    assert (arch.num_hidden_layers, arch.first_k_dense_replace) == (78, 3)
    assert (arch.hidden_size, arch.intermediate_size) == (6144, 12288)
    assert (arch.num_attention_heads, arch.q_lora_rank, arch.kv_lora_rank) == (64, 2048, 512)
    assert (arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim) == (192, 64, 256)
    assert (arch.index_n_heads, arch.index_head_dim, arch.index_topk) == (32, 128, 2048)
    assert (arch.n_routed_experts, arch.n_shared_experts, arch.num_experts_per_tok) == (256, 1, 8)
    assert arch.moe_intermediate_size == 2048
    assert (arch.routed_scaling_factor, arch.n_group, arch.topk_group, arch.norm_topk_prob) == (2.5, 1, 1, True)
    assert (arch.vocab_size, arch.max_position_embeddings, arch.num_nextn_predict_layers) == (154880, 202752, 1)
    assert arch.rope_theta == 1e6 and arch.kv_cache_width == 576
    assert arch.layer_mlp_types.count("dense") == 3 and len(arch.layer_indexer_types) == 78


def test_glm5_1_config_reads_in_transformers(hf_causal_lm, tmp_path):
    arch = load_section("glm5_1").arch
    arch.save(tmp_path)
    hf = hf_causal_lm.config_class.from_pretrained(tmp_path)
    for name in ("num_hidden_layers", "hidden_size", "q_lora_rank", "kv_lora_rank", "index_topk", "n_routed_experts",
                 "moe_intermediate_size", "eos_token_id"):
        assert getattr(hf, name) == getattr(arch, name), name
    assert hf.indexer_types == arch.layer_indexer_types and hf.mlp_layer_types == arch.layer_mlp_types
    assert hf.rope_parameters["rope_theta"] == 1e6
    reread = ModelConfig.from_pretrained(tmp_path)
    assert reread.to_hf_dict() == arch.to_hf_dict()


def test_tiny_yaml_is_a_small_full_featured_model():
    torch = pytest.importorskip("torch")
    from asyncrl.model.model import Glm5ForCausalLM

    section = load_section("tiny")
    arch = section.arch
    assert arch.vocab_size == 1024 and section.dtype == "float32" and section.tokenizer == "builtin:tiny"
    assert "shared" in arch.layer_indexer_types and arch.n_group > 1 and arch.first_k_dense_replace >= 1
    params = sum(p.numel() for p in Glm5ForCausalLM.from_config(arch).parameters())
    assert 1_000_000 <= params <= 5_000_000


def test_indexer_schedule_from_hf_keys_matches_transformers(hf_causal_lm):
    raw = {"model_type": "glm_moe_dsa", "num_hidden_layers": 12, "index_topk_freq": 4, "index_skip_topk_offset": 3}
    ours = ModelConfig.from_hf_dict(raw)
    theirs = hf_causal_lm.config_class(num_hidden_layers=12, index_topk_freq=4, index_skip_topk_offset=3)
    assert ours.layer_indexer_types == theirs.indexer_types
    patterned = ModelConfig.from_hf_dict({**raw, "index_topk_pattern": "FFSF" * 3})
    assert patterned.layer_indexer_types[:4] == ["full", "full", "shared", "full"]
