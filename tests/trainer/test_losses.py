import math

import pytest
import torch

from asyncrl.config import LossConfig
from asyncrl.plugins import load_object
from trainer.losses import (LOSSES, LossInputs, aggregate, build_loss, direct_double_sided_is_loss,
                            icepop_ppo_loss)

F64 = torch.float64


def t(values, dtype=F64, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def random_case(shape, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(shape, generator=g, dtype=F64) * 3).requires_grad_()
    rollout = logprobs.detach() + torch.randn(shape, generator=g, dtype=F64) * spread
    advantages = torch.randn(shape, generator=g, dtype=F64)
    mask = torch.rand(shape, generator=g) < 0.7
    return logprobs, rollout, advantages, mask


# Direct double-sided IS ------------------------------------------------------------------------
def test_is_gradient_equals_formula_on_hand_computed_case():
    logprobs = t([-1.0, -2.0, -0.5, -3.0, -0.7], grad=True)
    rollout = t([-1.1, -2.0, -0.2, -3.0, -1.0])
    adv = t([1.0, -0.5, 2.0, 0.7, 1.5])
    mask = torch.tensor([True, True, True, False, True])
    loss, metrics = direct_double_sided_is_loss(logprobs, rollout, adv, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    # r = exp(0.1) = 1.105 kept; exp(0) = 1 kept; exp(-0.3) = 0.741 < 0.8 masked; token 3 not a loss
    # token; exp(0.3) = 1.350 > 1.28 masked. Denominator: the 4 loss tokens (masked ones included).
    r0 = math.exp(0.1)
    assert loss.item() == pytest.approx(-(r0 * 1.0 * -1.0 + 1.0 * -0.5 * -2.0) / 4, abs=1e-12)
    expected_grad = [-r0 * 1.0 / 4, -1.0 * -0.5 / 4, 0.0, 0.0, 0.0]
    torch.testing.assert_close(logprobs.grad, t(expected_grad), rtol=0, atol=1e-12)
    summary = metrics.summary()
    assert summary["loss_tokens"] == 4 and summary["masked_fraction"] == 0.5
    assert summary["mean_ratio"] == pytest.approx((r0 + 1 + math.exp(-0.3) + math.exp(0.3)) / 4)
    assert summary["clip_fraction"] == 0


def test_is_gradient_equals_formula_on_random_batch():
    logprobs, rollout, adv, mask = random_case((64,), seed=1)
    loss, _ = direct_double_sided_is_loss(logprobs, rollout, adv, mask, 0.2, 0.28)
    loss.backward()
    r = torch.exp(logprobs.detach() - rollout)
    kept = mask & (r > 0.8) & (r < 1.28)
    assert 0 < kept.sum() < mask.sum()  # the case exercises both kept and masked loss tokens
    torch.testing.assert_close(logprobs.grad, torch.where(kept, -r * adv / mask.sum(), 0.0), rtol=0, atol=1e-12)


def test_on_policy_ratios_are_exactly_one_and_nothing_is_masked():
    logprobs, _, adv, mask = random_case((8, 16), seed=2)
    loss, metrics = direct_double_sided_is_loss(logprobs, logprobs.detach().clone(), adv, mask, 0.2, 0.28)
    loss.backward()
    assert int(metrics.masked_tokens) == 0
    assert metrics.ratio_sum.item() == mask.sum().item()  # every ratio exactly 1.0
    assert metrics.mismatch_kl_sum.item() == 0.0
    # on-policy, the objective is the plain policy gradient -A / N on every loss token
    torch.testing.assert_close(logprobs.grad, torch.where(mask, -adv / mask.sum(), 0.0), rtol=0, atol=1e-12)


def test_masked_and_non_loss_tokens_get_exactly_zero_gradient():
    logprobs, rollout, adv, mask = random_case((256,), seed=3, spread=1.0)
    rollout[~mask] = 0.0  # the store's convention for prompt tokens: garbage ratios there
    loss, _ = direct_double_sided_is_loss(logprobs, rollout, adv, mask, 0.2, 0.28)
    loss.backward()
    r = torch.exp(logprobs.detach() - rollout)
    dropped = ~(mask & (r > 0.8) & (r < 1.28))
    assert dropped.sum() > 100
    assert torch.equal(logprobs.grad[dropped], torch.zeros(int(dropped.sum()), dtype=F64))


def test_flat_and_batch_seq_shapes_agree():
    lengths = [5, 2, 7]
    logprobs, rollout, adv, mask = random_case((3, 7), seed=4)
    for row, n in enumerate(lengths):
        mask[row, n:] = False  # padding
    flat = [torch.cat([x[row, :n] for row, n in enumerate(lengths)]) for x in (logprobs, rollout, adv, mask)]
    flat_lp = flat[0].detach().clone().requires_grad_()
    cu = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    for how in ("token", "sequence"):
        logprobs.grad, flat_lp.grad = None, None
        loss2d, _ = direct_double_sided_is_loss(logprobs, rollout, adv, mask, 0.2, 0.28, aggregation=how)
        loss1d, _ = direct_double_sided_is_loss(flat_lp, *flat[1:], 0.2, 0.28, aggregation=how, cu_seqlens=cu)
        loss2d.backward()
        loss1d.backward()
        torch.testing.assert_close(loss1d, loss2d, rtol=0, atol=1e-12)
        grad2d_flat = torch.cat([logprobs.grad[row, :n] for row, n in enumerate(lengths)])
        torch.testing.assert_close(flat_lp.grad, grad2d_flat, rtol=0, atol=1e-12)
        assert torch.equal(logprobs.grad[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


# Aggregation ----------------------------------------------------------------------------------
def test_token_vs_sequence_aggregation_hand_computed():
    # sequence 0: one loss token (term 3); sequence 1: three loss tokens (terms 1, 2, 6) and a prompt token
    per_token = t([3.0, 0.0, 1.0, 2.0, 6.0])
    mask = torch.tensor([True, False, True, True, True])
    cu = torch.tensor([0, 1, 5], dtype=torch.int32)
    assert aggregate(per_token, mask, "token").item() == pytest.approx((3 + 1 + 2 + 6) / 4)
    assert aggregate(per_token, mask, "sequence", cu).item() == pytest.approx((3 / 1 + (1 + 2 + 6) / 3) / 2)
    # a sequence without loss tokens does not count towards the sequence mean
    cu_with_empty = torch.tensor([0, 1, 2, 5], dtype=torch.int32)  # token 1 alone: a prompt-only sequence
    assert aggregate(per_token, mask, "sequence", cu_with_empty).item() == pytest.approx((3 / 1 + (1 + 2 + 6) / 3) / 2)
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        aggregate(per_token, mask, "sequence")
    with pytest.raises(ValueError, match="not in"):
        aggregate(per_token, mask, "batch")


@pytest.mark.parametrize("how", ["token", "sequence"])
def test_micro_batches_with_step_normalizer_sum_to_the_full_batch(how):
    logprobs, rollout, adv, mask = random_case((6, 9), seed=5)
    full, _ = direct_double_sided_is_loss(logprobs, rollout, adv, mask, 0.2, 0.28, aggregation=how)
    (full_grad,) = torch.autograd.grad(full, logprobs)
    normalizer = int(mask.sum()) if how == "token" else int(mask.any(dim=1).sum())
    parts = [direct_double_sided_is_loss(logprobs[rows], rollout[rows], adv[rows], mask[rows], 0.2, 0.28,
                                         aggregation=how, normalizer=normalizer)[0]
             for rows in (slice(0, 2), slice(2, 6))]
    (parts_grad,) = torch.autograd.grad(sum(parts), logprobs)
    torch.testing.assert_close(sum(parts), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(parts_grad, full_grad, rtol=0, atol=1e-12)


def test_no_loss_tokens_gives_zero_loss_with_a_graph():
    logprobs, rollout, adv, _ = random_case((4,), seed=6)
    loss, metrics = direct_double_sided_is_loss(logprobs, rollout, adv, torch.zeros(4, dtype=torch.bool), 0.2, 0.28)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logprobs.grad, torch.zeros(4, dtype=F64))
    assert metrics.summary()["masked_fraction"] == 0.0


# IcePop + PPO ----------------------------------------------------------------------------------
def test_icepop_masks_weights_and_clips_hand_computed():
    # token: 0 kept/unclipped, 1 rho > beta (masked), 2 A>0 and r > 1+eps_high (clipped),
    #        3 A<0 and r < 1-eps_low (clipped), 4 A<0 and r > 1+eps_high (unclipped: min picks r*A),
    #        5 rho < 1/beta (masked), 6 not a loss token
    old = t([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    rollout = t([-1.2, -2.0, -1.0, -1.0, -1.1, -0.2, -5.0])
    logprobs = (old + t([0.1, 0.0, 0.5, -0.5, 0.4, 0.0, 0.0])).detach().requires_grad_()
    adv = t([1.0, 1.0, 2.0, -1.0, -1.0, 1.0, 1.0])
    mask = torch.tensor([True] * 6 + [False])
    loss, metrics = icepop_ppo_loss(logprobs, old, rollout, adv, mask, eps_low=0.2, eps_high=0.28, beta=2.0)
    loss.backward()
    rho = [math.exp(0.2), None, 1.0, 1.0, math.exp(0.1)]
    r = [math.exp(0.1), None, math.exp(0.5), math.exp(-0.5), math.exp(0.4)]
    n = 6
    expected_loss = -(rho[0] * r[0] * 1.0 + 1.0 * 1.28 * 2.0 + 1.0 * 0.8 * -1.0 + rho[4] * r[4] * -1.0) / n
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    expected_grad = [-rho[0] * r[0] * 1.0 / n, 0.0, 0.0, 0.0, -rho[4] * r[4] * -1.0 / n, 0.0, 0.0]
    torch.testing.assert_close(logprobs.grad, t(expected_grad), rtol=0, atol=1e-12)
    summary = metrics.summary()
    assert summary["masked_fraction"] == pytest.approx(2 / 6)
    assert summary["clip_fraction"] == pytest.approx(2 / 6)
    assert summary["mean_ratio"] == pytest.approx((rho[0] + math.exp(1.0) + 1 + 1 + rho[4] + math.exp(-0.8)) / 6)


def test_icepop_masked_tokens_get_exactly_zero_gradient_even_when_ratios_overflow():
    logprobs, rollout, adv, mask = random_case((64,), seed=11, spread=1.0)
    old = logprobs.detach() + torch.randn(64, dtype=F64) * 0.1
    old[~mask] = -1000.0  # garbage where no loss is taken: exp(logp - old) overflows to inf
    loss, _ = icepop_ppo_loss(logprobs, old, rollout, adv, mask)
    loss.backward()
    rho = torch.exp(old - rollout)
    dropped = ~(mask & (rho >= 0.5) & (rho <= 2.0))
    assert torch.isfinite(logprobs.grad).all() and dropped.sum() > 20
    assert torch.equal(logprobs.grad[dropped], torch.zeros(int(dropped.sum()), dtype=F64))


def test_icepop_on_policy_is_plain_policy_gradient():
    logprobs, _, adv, mask = random_case((5, 11), seed=7)
    same = logprobs.detach().clone()
    loss, metrics = icepop_ppo_loss(logprobs, same, same.clone(), adv, mask)
    loss.backward()
    assert int(metrics.masked_tokens) == 0 and int(metrics.clipped_tokens) == 0
    assert metrics.ratio_sum.item() == mask.sum().item()
    torch.testing.assert_close(logprobs.grad, torch.where(mask, -adv / mask.sum(), 0.0), rtol=0, atol=1e-12)


# Metrics and registry --------------------------------------------------------------------------
def test_mismatch_kl_estimates_kl_rollout_to_theta():
    g = torch.Generator().manual_seed(8)
    q = torch.softmax(torch.randn(12, generator=g, dtype=F64), 0)  # rollout policy (the sampler)
    p = torch.softmax(torch.randn(12, generator=g, dtype=F64), 0)  # current policy
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=g)
    logp, logq = p.log()[tokens], q.log()[tokens]
    _, metrics = direct_double_sided_is_loss(logp, logq, torch.zeros_like(logp),
                                             torch.ones_like(logp, dtype=torch.bool), 0.2, 0.28)
    kl_q_p = (q * (q.log() - p.log())).sum().item()
    assert metrics.summary()["mismatch_kl"] == pytest.approx(kl_q_p, rel=0.05)


def test_entropy_metric_and_metric_accumulation():
    logprobs, rollout, adv, mask = random_case((10,), seed=9)
    entropy = torch.arange(10, dtype=F64)
    _, a = direct_double_sided_is_loss(logprobs[:4], rollout[:4], adv[:4], mask[:4], 0.2, 0.28, entropy=entropy[:4])
    _, b = direct_double_sided_is_loss(logprobs[4:], rollout[4:], adv[4:], mask[4:], 0.2, 0.28, entropy=entropy[4:])
    total = (a + b).summary()
    assert total["entropy"] == pytest.approx(entropy[mask].mean().item())
    assert total["loss_tokens"] == mask.sum().item()
    assert "entropy" not in direct_double_sided_is_loss(logprobs, rollout, adv, mask, 0.2, 0.28)[1].summary()


def test_registry_builds_the_configured_loss():
    logprobs, rollout, adv, mask = random_case((3, 8), seed=10)
    inputs = LossInputs(logprobs, rollout, adv, mask)
    loss, _ = build_loss(LossConfig(type="direct_double_sided_is", eps_low=0.1, eps_high=0.2))(inputs)
    expected, _ = direct_double_sided_is_loss(logprobs, rollout, adv, mask, 0.1, 0.2)
    assert torch.equal(loss, expected)

    icepop = build_loss(LossConfig(type="icepop_ppo", aggregation="sequence", icepop_beta=3.0))
    assert icepop.needs_old_logprobs and not load_object(LOSSES["direct_double_sided_is"]).needs_old_logprobs
    with pytest.raises(ValueError, match="needs old_logprobs"):
        icepop(inputs)
    old = logprobs.detach() + 0.05
    loss, _ = icepop(LossInputs(logprobs, rollout, adv, mask, old_logprobs=old))
    expected, _ = icepop_ppo_loss(logprobs, old, rollout, adv, mask, 0.2, 0.28, 3.0, aggregation="sequence")
    assert torch.equal(loss, expected)

    with pytest.raises(ValueError, match="loss.type 'grpo' not in"):
        build_loss(LossConfig(type="grpo"))
    with pytest.raises(ValueError, match="loss.aggregation"):
        build_loss(LossConfig(aggregation="batch"))
