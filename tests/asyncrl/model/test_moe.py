"""MoE: the batched expert kernel and the group-limited router against direct per-token references."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from asyncrl.model.moe import Experts, MoE, Router
from tests.rollout.conftest import recorded_routing


def _experts_one_by_one(experts: Experts, x, ids, weights):
    """Reference: each (token, choice) through its expert separately."""
    out = torch.zeros_like(x)
    inter = experts.intermediate
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            e = ids[t, c]
            gate, up = experts.w_gate_up[e, :, :inter], experts.w_gate_up[e, :, inter:]
            h = F.silu(x[t] @ gate) * (x[t] @ up)
            out[t] = out[t] + weights[t, c] * (h @ experts.w_down[e])
    return out


def test_batched_experts_equal_per_token_reference_in_value_and_gradient(parity_config):
    torch.manual_seed(0)
    experts = Experts(parity_config)
    torch.nn.init.normal_(experts.w_gate_up, std=0.2)
    torch.nn.init.normal_(experts.w_down, std=0.2)
    x = torch.randn(13, parity_config.hidden_size, requires_grad=True)
    ids = torch.randint(0, 3, (13, 2))  # experts 3..7 get no token at all
    ids[:, 1] = (ids[:, 0] + 1) % 3
    weights = torch.rand(13, 2)
    fast = experts(x, ids, weights)
    (grad_fast,) = torch.autograd.grad(fast.square().sum(), x)
    slow = _experts_one_by_one(experts, x, ids, weights)
    (grad_slow,) = torch.autograd.grad(slow.square().sum(), x)
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad_fast, grad_slow, rtol=1e-5, atol=1e-4)


def _route_one_token(router: Router, x):
    """Reference for one token: sigmoid scores, group top-2 sums, keep groups, top-k, normalise, scale."""
    scores = torch.sigmoid(router.weight @ x)
    choice = scores + router.e_score_correction_bias
    groups = choice.view(router.n_group, -1)
    group_rank = groups.topk(2).values.sum(-1).argsort(descending=True)[: router.topk_group]
    allowed = torch.full_like(groups, float("-inf"))
    allowed[group_rank] = groups[group_rank]
    ids = allowed.flatten().topk(router.top_k).indices
    weights = scores[ids] / scores[ids].sum() * router.scaling
    return ids, weights


def test_router_keeps_the_best_group_and_weights_by_unbiased_scores(parity_config):
    config = dataclasses.replace(parity_config, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    torch.manual_seed(1)
    router = Router(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(20, config.hidden_size)
    ids, weights = router(x)
    for t in range(20):
        ref_ids, ref_weights = _route_one_token(router, x[t])
        order = ids[t].argsort()
        ref_order = ref_ids.argsort()
        assert torch.equal(ids[t][order], ref_ids[ref_order])
        assert torch.allclose(weights[t][order], ref_weights[ref_order], atol=1e-6)
    assert weights.dtype == torch.float32
    assert torch.allclose(weights.sum(-1), torch.full((20,), config.routed_scaling_factor))


def test_moe_adds_the_shared_expert(parity_config):
    torch.manual_seed(2)
    moe = MoE(parity_config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, parity_config.hidden_size)
    ids, weights = moe.gate(x)
    out, routed = moe(x)
    assert torch.allclose(out, moe.experts(x, ids, weights) + moe.shared_experts(x), atol=1e-6)
    assert torch.equal(routed, ids)


def test_routing_replay_of_the_models_own_routing_changes_nothing(parity_model):
    """R3 with the routing the model would choose anyway: same log-probs and the same router gradient;
    replaying other experts changes the log-probs, and the router still gets a gradient through its scores."""
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))
    cu, targets = torch.tensor([0, 40]), torch.roll(ids, -1)
    own = recorded_routing(parity_model, ids.tolist())
    router = parity_model.model.layers[1].mlp.gate.weight

    def run(routed):
        parity_model.zero_grad()
        out = parity_model.token_logprobs(ids, cu, targets, routed_experts=routed)
        out.logprobs.sum().backward()
        return out.logprobs.detach(), router.grad.clone()

    free_lp, free_grad = run(None)
    own_lp, own_grad = run(own)
    assert torch.equal(own_lp, free_lp) and torch.allclose(own_grad, free_grad, atol=1e-7)
    unset_lp, _ = run(torch.full_like(own, -1))  # -1 rows: the router decides
    assert torch.equal(unset_lp, free_lp)
    moe_layers = own[0] >= 0
    other = torch.where(moe_layers, (own + 1) % parity_model.config.n_routed_experts, own)
    other_lp, other_grad = run(other)
    assert (other_lp - free_lp).abs().max() > 1e-3 and other_grad.abs().sum() > 0
    partly = other.clone()
    partly[20:] = -1  # replay the first 20 positions only
    partly_lp, _ = run(partly)
    assert not torch.equal(partly_lp, free_lp) and not torch.equal(partly_lp, other_lp)
