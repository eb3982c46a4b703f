"""The MTP layer (asyncrl/model/mtp.py): its teacher-forced forward against a reference built from the HF
tensors, checkpoint round-trips, the GLM-5.1 tensor names, and that the policy loss leaves it untouched."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors.torch import save_file

from asyncrl.config import ModelSection
from asyncrl.model.attention import AttentionContext
from asyncrl.model.batch import ForwardBatch
from asyncrl.model.config import ModelConfig
from asyncrl.model.io import checkpoint_tensors, load_pretrained, load_weights, read_tensors, save_pretrained
from asyncrl.model.layers import DecoderLayer
from asyncrl.model.model import Glm5ForCausalLM, mtp_targets
from asyncrl.model.rope import RotaryEmbedding


MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
"""The MTP-specific tensors of layer num_hidden_layers + i; the rest are the usual decoder-layer tensors."""


@pytest.fixture
def mtp_config(parity_config) -> ModelConfig:
    return dataclasses.replace(parity_config, num_nextn_predict_layers=1)


@pytest.fixture
def mtp_model(mtp_config, randomize_bias) -> Glm5ForCausalLM:
    model = Glm5ForCausalLM.from_config(mtp_config, seed=1).eval()
    randomize_bias(model)
    return model


def _packed(seed: int, lens=(30, 45)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's (input_ids, targets = next tokens, cu_seqlens). Sequences longer than index_topk 16:
    the MTP block's own indexer selects sparsely."""
    seqs = [torch.randint(0, 512, (n + 1,), generator=torch.Generator().manual_seed(seed + i)) for i, n in enumerate(lens)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return torch.cat([s[:-1] for s in seqs]), torch.cat([s[1:] for s in seqs]), cu


def _reference_mtp_logprobs(tensors: dict[str, torch.Tensor], config: ModelConfig, hidden: torch.Tensor,
                            nxt: torch.Tensor) -> torch.Tensor:
    """One sequence, from the HF tensors: plain torch for the MTP wiring; the block is the parity-tested
    DecoderLayer class loaded with layer {L}'s decoder tensors. hidden[t] and nxt[t] = x_{t+1}
    -> log p(x_{t+2}) for t = 0..T-2."""
    prefix, eps = f"model.layers.{config.num_hidden_layers}.", config.rms_norm_eps
    t = {name[len(prefix):]: v for name, v in tensors.items() if name.startswith(prefix)}
    norm = lambda x, w: F.rms_norm(x, w.shape, w, eps)  # noqa: E731
    x = F.linear(torch.cat([norm(F.embedding(nxt, tensors["model.embed_tokens.weight"]), t["enorm.weight"]),
                            norm(hidden, t["hnorm.weight"])], -1), t["eh_proj.weight"])
    block = DecoderLayer(config, config.num_hidden_layers)
    block.load_state_dict({k: v for k, v in t.items() if k not in MTP_OWN}, strict=True)
    batch = ForwardBatch.packed(nxt, torch.tensor([0, len(nxt)]))
    x, _ = block(x, AttentionContext(batch, RotaryEmbedding(config)(batch.positions)), None)
    logits = F.linear(norm(x, t["shared_head.norm.weight"]), tensors["lm_head.weight"])
    return logits[:-1].log_softmax(-1).gather(1, nxt[1:, None]).squeeze(1)


def test_mtp_forward_equals_a_reference_built_from_the_hf_tensors(mtp_model, mtp_config):
    ids, nxt, cu = _packed(0)
    targets, valid = mtp_targets(nxt, cu)
    tensors = checkpoint_tensors(mtp_model)
    with torch.no_grad():
        hidden = mtp_model.token_logprobs(ids, cu, nxt).hidden
        for impl in ("auto", "sparse", "dense"):
            out = mtp_model.mtp_logprobs(hidden, nxt, cu, targets, attention_impl=impl)
            for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
                theirs = _reference_mtp_logprobs(tensors, mtp_config, hidden[start:end], nxt[start:end])
                assert (out.logprobs[start:end - 1] - theirs).abs().max() <= 1e-5, impl
                assert valid[start:end - 1].all() and not valid[end - 1]
    assert theirs.abs().max() > 1.0  # O(1) log-probs: the tolerance means something


def test_mtp_layer_can_be_fed_its_own_output_for_a_second_draft(mtp_model):
    ids, nxt, cu = _packed(1, lens=(20,))
    with torch.no_grad():
        first = mtp_model.mtp_logprobs(mtp_model.token_logprobs(ids, cu, nxt).hidden, nxt, cu, mtp_targets(nxt, cu)[0])
        second = mtp_model.mtp_logprobs(first.hidden[:-1], nxt[1:], torch.tensor([0, 19]), nxt[1:])
    assert first.hidden.shape == (20, mtp_model.config.hidden_size) and second.logprobs.isfinite().all()


def test_mtp_loss_trains_the_mtp_layer_only(mtp_model):
    """The main model enters mtp_logprobs detached: an MTP loss gives no main tensor a gradient."""
    ids, nxt, cu = _packed(4)
    out = mtp_model.token_logprobs(ids, cu, nxt)
    mtp_model.mtp_logprobs(out.hidden, nxt, cu, mtp_targets(nxt, cu)[0]).logprobs.sum().backward()
    grads = {n: p.grad for n, p in mtp_model.named_parameters()}
    assert all(g is None for n, g in grads.items() if not n.startswith("model.mtp_layers."))
    for own in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.q_b_proj", "mlp.gate"):  # not the
        assert grads[f"model.mtp_layers.0.{own}.weight"].abs().sum() > 0, own  # indexer, nor unrouted experts


def test_checkpoint_round_trip_keeps_mtp_tensors_and_outputs(mtp_model, tmp_path):
    save_pretrained(mtp_model, tmp_path)
    loaded = load_pretrained(tmp_path)
    ours, theirs = checkpoint_tensors(mtp_model), checkpoint_tensors(loaded)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert {f"model.layers.4.{name}" for name in MTP_OWN} <= set(read_tensors(tmp_path))
    ids, nxt, cu = _packed(2)
    with torch.no_grad():
        a, b = (m.mtp_logprobs(m.token_logprobs(ids, cu, nxt).hidden, nxt, cu, nxt) for m in (mtp_model, loaded))
    assert torch.equal(a.logprobs, b.logprobs)


def test_mtp_copies_of_embedding_and_head_are_written_back(mtp_model, mtp_config, tmp_path):
    """DeepSeek-V3-style checkpoints repeat embed_tokens / shared_head.head inside the MTP layer."""
    tensors = checkpoint_tensors(mtp_model)
    copies = {"model.layers.4.embed_tokens.weight": tensors["model.embed_tokens.weight"],
              "model.layers.4.shared_head.head.weight": tensors["lm_head.weight"]}
    mtp_config.save(tmp_path / "in")
    save_file({**tensors, **{n: t.clone() for n, t in copies.items()}}, tmp_path / "in" / "model.safetensors")
    save_pretrained(load_pretrained(tmp_path / "in"), tmp_path / "out")
    written = read_tensors(tmp_path / "out")
    assert written.keys() == read_tensors(tmp_path / "in").keys()
    assert all(torch.equal(written[n], t) for n, t in copies.items())
    bad = {**tensors, "model.layers.4.embed_tokens.weight": tensors["model.embed_tokens.weight"] + 1}
    with pytest.raises(ValueError, match="embed_tokens"):
        load_weights(Glm5ForCausalLM(mtp_config), bad)


def test_policy_loss_gives_mtp_parameters_no_gradient(mtp_model):
    ids, nxt, cu = _packed(3)
    mtp_model.token_logprobs(ids, cu, nxt).logprobs.sum().backward()
    mtp_params = list(mtp_model.model.mtp_layers.parameters())
    assert mtp_params and all(p.grad is None for p in mtp_params)
    assert mtp_model.model.layers[1].self_attn.q_b_proj.weight.grad is not None
    mtp_model.freeze_mtp()  # what the torch trainer does until there is an MTP loss
    assert not any(p.requires_grad for p in mtp_params)


def test_main_weights_do_not_depend_on_the_mtp_layer(parity_config, mtp_config):
    """MTP parameters draw their init last: adding the layer leaves every seeded main tensor unchanged."""
    without, with_mtp = (Glm5ForCausalLM.from_config(c, seed=4).state_dict() for c in (parity_config, mtp_config))
    assert all(torch.equal(t, with_mtp[n]) for n, t in without.items())


def test_transformers_loads_a_checkpoint_with_mtp_tensors(mtp_model, load_hf, tmp_path):
    """transformers ignores only model.layers.78.*; it drops the tiny model's layer-4 tensors as unexpected
    keys (a logged warning) and its logits still equal ours."""
    save_pretrained(mtp_model, tmp_path)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (load_hf(tmp_path)(ids).logits - mtp_model(ids)).abs().max() <= 1e-5


def _glm5_1_config(**dims) -> ModelConfig:
    yaml = OmegaConf.load(Path(__file__).resolve().parents[3] / "configs" / "model" / "glm5_1.yaml")
    section = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelSection), yaml))
    return dataclasses.replace(section.arch, **dims)


def test_glm5_1_names_every_mtp_tensor():
    """On the meta device (no memory): layer 78's names are layer 77's (a MoE layer with its own indexer,
    names parity-tested against transformers) plus the four MTP tensors, with the published shapes."""
    config = _glm5_1_config()
    with torch.device("meta"):
        state = Glm5ForCausalLM(config).state_dict()
    decoder = {name.replace("model.layers.77.", "model.layers.78.") for name in state
               if name.startswith("model.layers.77.")}
    expected = decoder | {f"model.layers.78.{name}" for name in MTP_OWN}
    assert {name for name in state if name.startswith("model.layers.78.")} == expected
    assert not any(name.startswith("model.layers.79.") or "mtp_layers" in name for name in state)
    assert "model.layers.78.self_attn.indexer.wq_b.weight" in expected
    assert "model.layers.78.mlp.experts.255.down_proj.weight" in expected
    assert state["model.layers.78.eh_proj.weight"].shape == (6144, 12288)
    for name in decoder:
        assert state[name].shape == state[name.replace(".78.", ".77.")].shape, name


def test_glm5_1_structure_loads_every_mtp_tensor_by_name():
    """Tiny dims, GLM-5.1's layer structure (78 layers, 256 experts, 1 MTP layer): every HF-named MTP tensor
    lands in the module and comes back under the same name."""
    config = _glm5_1_config(hidden_size=16, intermediate_size=16, moe_intermediate_size=4, q_lora_rank=8,
                            kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                            num_attention_heads=2, num_key_value_heads=2, index_n_heads=2, index_head_dim=4,
                            vocab_size=32)
    source = Glm5ForCausalLM.from_config(config, seed=0, dtype=torch.float32)
    tensors = checkpoint_tensors(source)
    mtp = {name for name in tensors if name.startswith("model.layers.78.")}
    target = Glm5ForCausalLM(config)
    load_weights(target, tensors)
    loaded = checkpoint_tensors(target)
    assert all(torch.equal(loaded[name], tensors[name]) for name in mtp) and len(mtp) > 256 * 3
