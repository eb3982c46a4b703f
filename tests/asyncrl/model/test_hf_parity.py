"""Parity with transformers 5.24.0 GlmMoeDsaForCausalLM: same safetensors in both, fp32 logits within 1e-5."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.model.io import checkpoint_tensors, load_pretrained, save_pretrained
from asyncrl.model.model import Glm5ForCausalLM
from tests.rollout.conftest import recorded_routing

TOLERANCE = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {"default": {}, "tied_embeddings": {"tie_word_embeddings": True}, "yarn": {"rope_parameters": YARN}}


def _tokens(seed: int, shape=(3, 80)) -> torch.Tensor:
    return torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_asyncrl_checkpoint_gives_transformers_the_same_logits(variant, parity_config, randomize_bias, load_hf,
                                                               tmp_path):
    config = dataclasses.replace(parity_config, **VARIANTS[variant])
    model = Glm5ForCausalLM.from_config(config, seed=0).eval()
    randomize_bias(model)
    save_pretrained(model, tmp_path)
    reference = load_hf(tmp_path)
    ids = _tokens(0)  # 80 tokens > index_topk 16: the sparse selection decides the output
    with torch.no_grad():
        theirs = reference(ids).logits
        for impl in ("auto", "sparse", "dense"):
            ours = model(ids, attention_impl=impl)
            assert (ours - theirs).abs().max().item() <= TOLERANCE, impl
    assert theirs.abs().max() > 1.0  # logits of O(1): the tolerance is meaningful


def test_transformers_checkpoint_gives_asyncrl_the_same_logits(parity_config, hf_causal_lm, randomize_bias, load_hf,
                                                               tmp_path):
    parity_config.save(tmp_path / "config")
    hf_config = hf_causal_lm.config_class.from_pretrained(tmp_path / "config")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        reference = hf_causal_lm(hf_config).eval()
    randomize_bias(reference, seed=1)
    reference.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf").eval()
    ids = _tokens(1)
    with torch.no_grad():
        assert (model(ids) - reference(ids).logits).abs().max().item() <= TOLERANCE


def test_tensor_names_and_shapes_equal_transformers(parity_model, load_hf, tmp_path):
    save_pretrained(parity_model, tmp_path / "ours")
    load_hf(tmp_path / "ours").save_pretrained(tmp_path / "hf")
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    ours = checkpoint_tensors(parity_model)
    assert set(ours) == set(theirs)
    assert all(ours[name].shape == theirs[name].shape and torch.equal(ours[name], theirs[name]) for name in ours)
    assert "model.layers.1.self_attn.indexer.wq_b.weight" in ours
    assert "model.layers.2.self_attn.indexer.wq_b.weight" not in ours  # the shared-indexer layer has none
    assert "model.layers.3.mlp.experts.7.gate_proj.weight" in ours
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in ours


def test_recorded_routing_equals_transformers_expert_choice(parity_model, load_hf, tmp_path):
    """The experts a KVCache records per token and MoE layer (what the engine returns for routing replay)
    are the ones transformers' router picks for the same tokens."""
    save_pretrained(parity_model, tmp_path)
    reference = load_hf(tmp_path)
    theirs = {}
    for i, layer in enumerate(reference.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda m, args, out, i=i: theirs.__setitem__(i, out[2]))
    ids = _tokens(2, (1, 60))
    with torch.no_grad():
        reference(ids)
    recorded = recorded_routing(parity_model, ids[0].tolist())  # [60, layers, k]
    moe_layers = [i for i, kind in enumerate(parity_model.config.layer_mlp_types) if kind == "sparse"]
    assert sorted(theirs) == moe_layers and moe_layers
    for layer in moe_layers:
        assert torch.equal(recorded[:, layer].sort(-1).values, theirs[layer].int().sort(-1).values), layer
    assert (recorded[:, [i for i in range(recorded.shape[1]) if i not in moe_layers]] == -1).all()
    assert len({tuple(row.tolist()) for row in recorded[:, moe_layers[0]]}) > 3  # routing varies by token
