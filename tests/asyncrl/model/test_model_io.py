"""HF-format checkpoints: sharding with index json (MTP layers: test_mtp.py), tied embeddings, bf16 dtypes, seeded init."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.model.io import INDEX_FILE, checkpoint_tensors, load_pretrained, save_pretrained
from asyncrl.model.model import Glm5ForCausalLM


def _same_weights(a: Glm5ForCausalLM, b: Glm5ForCausalLM) -> bool:
    left, right = checkpoint_tensors(a), checkpoint_tensors(b)
    return left.keys() == right.keys() and all(torch.equal(left[n], right[n]) for n in left)


def test_sharded_checkpoint_round_trips_with_an_index(parity_model, tmp_path):
    save_pretrained(parity_model, tmp_path, max_shard_bytes=200_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(checkpoint_tensors(parity_model))
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in checkpoint_tensors(parity_model).values())
    assert _same_weights(load_pretrained(tmp_path), parity_model)


def test_sharded_checkpoint_loads_in_transformers(parity_model, load_hf, tmp_path):
    save_pretrained(parity_model, tmp_path, max_shard_bytes=200_000)
    ids = torch.randint(0, 512, (1, 40))
    with torch.no_grad():
        assert (load_hf(tmp_path)(ids).logits - parity_model(ids)).abs().max() <= 1e-5


def test_tied_embeddings_save_no_lm_head(parity_config, tmp_path):
    model = Glm5ForCausalLM.from_config(dataclasses.replace(parity_config, tie_word_embeddings=True), seed=3)
    save_pretrained(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight and _same_weights(loaded, model)


def test_bf16_checkpoint_keeps_the_router_in_fp32_like_transformers(parity_model, load_hf,
                                                                                   hf_causal_lm, tmp_path):
    save_pretrained(parity_model, tmp_path / "ours", dtype=torch.bfloat16)
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert ours["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert ours["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.bfloat16
    hf_causal_lm.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16).save_pretrained(tmp_path / "hf")
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    assert {n: t.dtype for n, t in theirs.items()} == {n: t.dtype for n, t in ours.items()}
    loaded = load_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16 and loaded.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ids = torch.randint(0, 512, (1, 12))  # within index_topk: bf16 noise cannot flip the selection
    with torch.no_grad():
        reference = parity_model(ids)
        assert (loaded(ids) - reference).norm() / reference.norm() < 0.05  # bf16 rounding only (measured 1.4%)


def test_random_init_is_deterministic_in_the_seed(parity_config):
    state = torch.get_rng_state()
    a, b = (Glm5ForCausalLM.from_config(parity_config, seed=7) for _ in range(2))
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    assert _same_weights(a, b)
    assert not _same_weights(a, Glm5ForCausalLM.from_config(parity_config, seed=8))


def test_mismatched_checkpoint_is_refused_with_names(parity_model, tmp_path):
    save_pretrained(parity_model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.indexer.wk.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="indexer.wk.weight"):
        load_pretrained(tmp_path)
