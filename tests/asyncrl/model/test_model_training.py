"""Training path: teacher-forced log-probs / entropy of packed sequences and their gradients against
transformers, gradient checkpointing, freeze_indexer, and the DeepSeek-V3.2 indexer KL loss."""

from __future__ import annotations

import dataclasses

import torch

from asyncrl.model.batch import ForwardBatch
from asyncrl.model.io import save_pretrained
from asyncrl.model.model import Glm5ForCausalLM

LENGTHS = [37, 20, 51]


def _packed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [N], cu_seqlens [B + 1], targets [N] (next token within each sequence, last one wraps)."""
    generator = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 512, (n,), generator=generator) for n in LENGTHS]
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    return torch.cat(seqs), cu, torch.cat([s.roll(-1) for s in seqs])


def _hf_logprobs_and_entropy(reference, ids, cu, targets):
    logps, entropies = [], []
    for start, end in zip(cu[:-1], cu[1:]):
        logp_all = reference(ids[None, start:end]).logits[0].float().log_softmax(-1)
        logps.append(logp_all.gather(1, targets[start:end, None]).squeeze(1))
        entropies.append(-(logp_all.exp() * logp_all).sum(-1))
    return torch.cat(logps), torch.cat(entropies)


def test_packed_logprobs_entropy_and_gradients_match_transformers(parity_model, load_hf, tmp_path):
    save_pretrained(parity_model, tmp_path)
    reference = load_hf(tmp_path)
    ids, cu, targets = _packed()
    ours = parity_model.token_logprobs(ids, cu, targets)
    theirs_logp, theirs_entropy = _hf_logprobs_and_entropy(reference, ids, cu, targets)
    assert (ours.logprobs - theirs_logp).abs().max() <= 1e-5
    assert (ours.entropy - theirs_entropy).abs().max() <= 1e-5
    ours.logprobs.sum().backward()
    theirs_logp.sum().backward()
    ours_grads = {name: p.grad for name, p in parity_model.named_parameters()}
    theirs_grads = {name: p.grad for name, p in reference.named_parameters()}
    for name in ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.q_a_proj.weight",
                 "model.layers.3.mlp.gate.weight", "model.layers.2.mlp.shared_experts.down_proj.weight",
                 "model.embed_tokens.weight", "lm_head.weight"):
        assert torch.allclose(ours_grads[name], theirs_grads[name], rtol=1e-4, atol=1e-5), name
    experts_ours = ours_grads["model.layers.1.mlp.experts.w_gate_up"]  # [E, H, 2I] = HF gate_up_proj^T
    experts_theirs = theirs_grads["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.allclose(experts_ours, experts_theirs.transpose(1, 2), rtol=1e-4, atol=1e-5)
    assert all(p.grad is None for p in parity_model.indexer_parameters())  # top-k is not differentiable


def test_temperature_divides_the_logits(parity_model):
    ids, cu, targets = _packed(1)
    with torch.no_grad():
        hot = parity_model.token_logprobs(ids, cu, targets, temperature=2.0, with_entropy=False)
        logits = torch.cat([parity_model(ids[None, s:e])[0] for s, e in zip(cu[:-1], cu[1:])])
    expected = (logits / 2.0).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    assert hot.entropy is None and (hot.logprobs - expected).abs().max() <= 1e-5


def test_gradient_checkpointing_gives_the_same_gradients(parity_config):
    ids, cu, targets = _packed(2)
    grads = []
    for checkpointing in (False, True):
        model = Glm5ForCausalLM.from_config(parity_config, seed=5)
        model.set_gradient_checkpointing(checkpointing)
        out = model.token_logprobs(ids, cu, targets)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


def test_frozen_indexer_is_bit_identical_after_optimizer_steps_while_the_rest_moves(parity_config):
    model = Glm5ForCausalLM.from_config(parity_config, seed=6)
    model.freeze_indexer()
    frozen = {id(p) for p in model.indexer_parameters()}
    assert frozen and all(not p.requires_grad for p in model.indexer_parameters())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    for step in range(3):
        ids, cu, targets = _packed(10 + step)
        loss = -model.token_logprobs(ids, cu, targets, with_entropy=False).logprobs.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for name, p in model.named_parameters():
        unchanged = torch.equal(p, before[name])
        assert unchanged == (id(p) in frozen), name


def test_indexer_kl_trains_only_the_indexer_and_decreases(parity_config):
    model = Glm5ForCausalLM.from_config(parity_config, seed=7)
    ids, cu, targets = _packed(3)
    out = model.token_logprobs(ids, cu, targets, indexer_kl=True)
    assert out.indexer_kl.item() > 0
    out.indexer_kl.backward()
    indexer = {id(p) for p in model.indexer_parameters()}
    for name, p in model.named_parameters():
        has_grad = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert has_grad == (id(p) in indexer), name
    optimizer = torch.optim.Adam(model.indexer_parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        kl = model.token_logprobs(ids, cu, targets, with_entropy=False, indexer_kl=True).indexer_kl
        optimizer.zero_grad()
        kl.backward()
        optimizer.step()
        losses.append(kl.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_indexer_kl_equals_a_direct_computation_from_transformers_attention(parity_config, load_hf, tmp_path):
    """With index_topk >= T every causal key is selected: the loss is the dense-stage KL of DeepSeek-V3.2,
    computed here from transformers' attention weights and a from-scratch indexer score."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    config = dataclasses.replace(parity_config, num_hidden_layers=1, indexer_types=["full"], first_k_dense_replace=1,
                                 index_topk=64)
    model = Glm5ForCausalLM.from_config(config, seed=8)
    save_pretrained(model, tmp_path)
    reference = load_hf(tmp_path)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(4))
    ours = model.token_logprobs(ids[0], torch.tensor([0, 30]), ids[0], indexer_kl=True).indexer_kl
    with torch.no_grad():
        out = reference(ids, output_attentions=True, output_hidden_states=True)
        attn = reference.model.layers[0].self_attn
        x = reference.model.layers[0].input_layernorm(out.hidden_states[0])  # the attention input
        cos, sin = reference.model.rotary_emb(x, torch.arange(30)[None])
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        idx = attn.indexer
        q = idx.wq_b(q_resid).view(1, 30, idx.n_heads, idx.head_dim)
        k = idx.k_norm(idx.wk(x))[:, :, None]
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :16], k[..., :16], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., 16:]], -1), torch.cat([k_rot, k[..., 16:]], -1)[:, :, 0]
        scores = torch.relu(torch.einsum("bthd,bsd->bths", q, k) * idx.head_dim**-0.5)
        index = torch.einsum("bth,bths->bts", idx.weights_proj(x) * idx.n_heads**-0.5, scores)[0]
        causal = torch.ones(30, 30, dtype=torch.bool).tril()
        log_q = index.masked_fill(~causal, float("-inf")).log_softmax(-1)
        p = out.attentions[0][0].sum(0)
        p = p / p.sum(-1, keepdim=True)
        expected = (torch.xlogy(p, p) - p * log_q.masked_fill(~causal, 0)).sum(-1).mean()
    assert abs(ours.item() - expected.item()) <= 1e-5 * max(1.0, expected.item())


def test_sparse_gather_and_dense_mask_kernels_agree_in_value_and_gradient(parity_config):
    ids, cu, targets = _packed(4)  # contexts of 20..51 tokens, index_topk 16: the selection matters
    results = []
    for impl in ("sparse", "dense"):
        model = Glm5ForCausalLM.from_config(parity_config, seed=9)
        out = model.token_logprobs(ids, cu, targets, attention_impl=impl)
        out.logprobs.sum().backward()
        results.append((out.logprobs.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (sparse, sparse_grads), (dense, dense_grads) = results
    assert (sparse - dense).abs().max() <= 1e-5
    assert sparse_grads.keys() == dense_grads.keys()
    assert all(torch.allclose(sparse_grads[n], dense_grads[n], rtol=1e-4, atol=1e-5) for n in sparse_grads)


def test_length_groups_give_the_ungrouped_values_gradients_and_indexer_kl(parity_config):
    """A packed batch of very different lengths attends per length group (ForwardBatch.length_groups);
    the result is that of one padded layout over all sequences."""
    generator = torch.Generator().manual_seed(5)
    lengths = [90, 12, 40, 7, 95, 20]
    ids = torch.randint(0, 512, (sum(lengths),), generator=generator)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    targets = ids.roll(-1)
    assert ForwardBatch.packed(ids, cu, group_min_pairs=0).length_groups() == [[4, 0], [2, 5], [1, 3]]
    for impl in ("sparse", "dense"):
        results = []
        for grouping in ({"group_min_pairs": 0}, {"group_length_ratio": 0}):
            model = Glm5ForCausalLM.from_config(parity_config, seed=3)
            out = model.token_logprobs(ids, cu, targets, attention_impl=impl, indexer_kl=impl == "sparse", **grouping)
            loss = out.logprobs.sum() + (out.indexer_kl if out.indexer_kl is not None else 0.0)
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            results.append((out.logprobs.detach(), out.indexer_kl, grads))
        (grouped, kl, grads), (ungrouped, kl_ref, grads_ref) = results
        assert (grouped - ungrouped).abs().max() <= 1e-5, impl
        assert kl is None or abs(kl.item() - kl_ref.item()) <= 1e-6
        assert grads.keys() == grads_ref.keys()
        assert all(torch.allclose(grads[n], grads_ref[n], rtol=1e-4, atol=1e-5) for n in grads), impl
